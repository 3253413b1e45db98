// The cryptographic primitives the core needs, from OpenSSL's libcrypto: a
// source of random bytes, HMAC-SHA256 and a constant-time comparison. Thin
// wrappers, so that no caller touches OpenSSL's API and nothing here is
// written by hand. Used to authenticate TCP connections between ranks
// (Note [Authenticating a connection] in comm/tcp_handshake.h) and to make a
// job's secret key at init. libcrypto is found at run time, by soname: see
// Note [Loading libcrypto at run time] in crypto.cc.
#ifndef HVDMX_CRYPTO_H_
#define HVDMX_CRYPTO_H_

#include <cstddef>
#include <string>

namespace hvdmx {

// HMAC-SHA256's output, and the size of a job's secret key (256 bits).
constexpr size_t kMacBytes = 32;
constexpr size_t kSecretKeyBytes = 32;

// Every function below that uses libcrypto throws std::runtime_error naming
// the library and the fix when no libcrypto can be loaded.

// `n` bytes from the operating system's random source, through OpenSSL's
// generator. Throws std::runtime_error if it cannot give them.
std::string RandomBytes(size_t n);

// HMAC-SHA256 of `message` under `key`: kMacBytes bytes.
std::string HmacSha256(const std::string& key, const std::string& message);

// Whether a and b hold the same bytes, in a time that depends on their
// length only (where they differ does not show).
bool SameBytesConstantTime(const std::string& a, const std::string& b);

// Lower-case hex of `bytes`, and its inverse (false on anything that is not
// an even number of hex digits).
std::string ToHex(const std::string& bytes);
bool FromHex(const std::string& hex, std::string* bytes);

}  // namespace hvdmx

#endif  // HVDMX_CRYPTO_H_
