#include "base/crypto.h"

#include <dlfcn.h>

#include <cstdlib>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace hvdmx {

// Note [Loading libcrypto at run time]
// ------------------------------------
// The core does not link libcrypto: it opens it by soname on first use, and
// takes the four functions it calls with dlsym. Why: a binary wheel must run
// where OpenSSL's headers are absent, and on a glibc older than the build
// machine's. Linking Debian's libcrypto.so.3 would record NEEDED on a library
// that itself needs GLIBC_2.34 (capping the wheel at manylinux_2_34), and
// grafting a copy into the wheel would ship a second OpenSSL to patch. Every
// Linux distribution ships a libcrypto: OpenSSL 3 (libcrypto.so.3) since
// RHEL 9, Debian 12 and Ubuntu 22.04, OpenSSL 1.1 (libcrypto.so.1.1) before.
// The four functions have the same signatures in both. The development build
// uses this path too, so that every test of the TCP handshake checks what the
// wheel runs (and the build needs no OpenSSL headers).
//
// HVDMX_LIBCRYPTO names the library to open instead (a path or a soname); then
// nothing else is tried.

namespace {

// OpenSSL's signatures, declared here rather than taken from its headers.
struct EvpMd;  // EVP_MD, opaque
using RandBytesFn = int (*)(unsigned char*, int);
using EvpSha256Fn = const EvpMd* (*)();
using HmacFn = unsigned char* (*)(const EvpMd*, const void*, int, const unsigned char*, size_t,
                                  unsigned char*, unsigned int*);
using CryptoMemcmpFn = int (*)(const void*, const void*, size_t);

constexpr const char* kSonames[] = {"libcrypto.so.3", "libcrypto.so.1.1"};
constexpr const char* kInstallFix =
    "install OpenSSL's library (Debian/Ubuntu: apt-get install libssl3, or libssl1.1 on "
    "older releases; RHEL/Fedora: dnf install openssl-libs; conda: conda install openssl), "
    "or set HVDMX_LIBCRYPTO to the path of a libcrypto.so";

struct Libcrypto {
  std::string name;  // what was opened
  RandBytesFn rand_bytes = nullptr;
  EvpSha256Fn evp_sha256 = nullptr;
  HmacFn hmac = nullptr;
  CryptoMemcmpFn crypto_memcmp = nullptr;
  std::string error;  // non-empty: unusable, and why (with the fix)
};

template <typename Fn>
bool Resolve(void* handle, const char* symbol, Fn* fn, Libcrypto* lib) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (*fn == nullptr) {
    lib->error = "hvdmx: " + lib->name + " has no function " + symbol +
                 " (is it OpenSSL's libcrypto, version 1.1 or 3?); " + kInstallFix;
  }
  return *fn != nullptr;
}

Libcrypto Load() {
  Libcrypto lib;
  std::vector<std::string> names;
  const char* chosen = std::getenv("HVDMX_LIBCRYPTO");
  if (chosen != nullptr && chosen[0] != '\0') {
    names.push_back(chosen);
  } else {
    names.assign(std::begin(kSonames), std::end(kSonames));
  }
  std::string tried;
  void* handle = nullptr;
  for (const std::string& name : names) {
    // RTLD_LOCAL: the symbols stay out of the process's global scope, where
    // they could satisfy another library's references to a different OpenSSL.
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      lib.name = name;
      break;
    }
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(why != nullptr ? why : name.c_str());
  }
  if (handle == nullptr) {
    lib.error = std::string("hvdmx: cannot load OpenSSL's libcrypto, which authenticates ") +
                "the connections between ranks (" + tried + "); " + kInstallFix;
    return lib;
  }
  // The handle is never closed: the functions are used until the process exits.
  Resolve(handle, "RAND_bytes", &lib.rand_bytes, &lib) &&
      Resolve(handle, "EVP_sha256", &lib.evp_sha256, &lib) &&
      Resolve(handle, "HMAC", &lib.hmac, &lib) &&
      Resolve(handle, "CRYPTO_memcmp", &lib.crypto_memcmp, &lib);
  return lib;
}

// Loaded once, on first use, by whichever thread gets here first (a
// function-local static's initialization is thread-safe).
const Libcrypto& Crypto() {
  static const Libcrypto lib = Load();
  if (!lib.error.empty()) throw std::runtime_error(lib.error);
  return lib;
}

}  // namespace

std::string RandomBytes(size_t n) {
  const Libcrypto& lib = Crypto();
  std::string out(n, '\0');
  if (n > 0 &&
      lib.rand_bytes(reinterpret_cast<unsigned char*>(&out[0]), static_cast<int>(n)) != 1) {
    throw std::runtime_error(
        "hvdmx: OpenSSL's random generator (RAND_bytes) could not give " + std::to_string(n) +
        " random bytes; the operating system's random source may be unavailable");
  }
  return out;
}

std::string HmacSha256(const std::string& key, const std::string& message) {
  const Libcrypto& lib = Crypto();
  unsigned char mac[64];  // EVP_MAX_MD_SIZE: room for any digest HMAC may write
  unsigned int len = 0;
  if (lib.hmac(lib.evp_sha256(), key.data(), static_cast<int>(key.size()),
               reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
               &len) == nullptr ||
      len != kMacBytes) {
    throw std::runtime_error("hvdmx: OpenSSL's HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool SameBytesConstantTime(const std::string& a, const std::string& b) {
  return a.size() == b.size() && Crypto().crypto_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string ToHex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

bool FromHex(const std::string& hex, std::string* bytes) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) return false;
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  *bytes = std::move(out);
  return true;
}

}  // namespace hvdmx
