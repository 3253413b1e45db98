"""The rules of an elastic job's hosts (hvdmx/runner/elastic/hosts.py): the
discovery script's output, the blacklist's cooldown, and how a new
membership is numbered."""
import os
import stat

import pytest
from hypothesis import given, strategies as st

from hvdmx.runner.elastic.hosts import HostManager, number_ranks, parse_discovery_output, \
    run_discovery_script, slots_of
from hvdmx.runner.elastic.slurm_discovery import SlurmDiscovery, parse_sinfo, runs_jobs, \
    sinfo_command, usable
from hvdmx.runner.hosts import Host, UsageError


def test_discovery_output_with_and_without_slots():
    assert parse_discovery_output("a:2\n\n b \nc:1\n", 3, "s") == {"a": 2, "b": 3, "c": 1}


@pytest.mark.parametrize("text, slots, message", [
    ("a:0\n", None, r"line 1 'a:0': the slots after ':' must be a whole number >= 1"),
    ("a:x\n", None, r"line 1 'a:x': the slots after ':' must be a whole number"),
    ("a\n", None, r"line 1 'a': it gives no slots; print 'host:slots', or pass --slots-per-host"),
    ("a:1\nb:1\na:2\n", None, r"line 3 'a:2': host 'a' is listed twice"),
    (":3\n", None, r"line 1 ':3': expected 'host' or 'host:slots'"),
])
def test_bad_discovery_output_names_the_script_and_the_line(text, slots, message):
    with pytest.raises(UsageError, match=r"--host-discovery-script 'find.sh' printed " + message):
        parse_discovery_output(text, slots, "find.sh")


def script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_discovery_script_runs_and_its_failure_is_named(tmp_path):
    assert run_discovery_script(script(tmp_path, "echo h1:2; echo h2\n"), 1) == {"h1": 2, "h2": 1}
    failing = script(tmp_path, "echo no hosts file >&2; exit 3\n")
    with pytest.raises(UsageError, match=r"exited with status 3: no hosts file"):
        run_discovery_script(failing, 1)
    with pytest.raises(UsageError, match=r"could not be run"):
        run_discovery_script(os.path.join(str(tmp_path), "missing"), 1)


def test_a_failed_host_waits_out_a_doubling_cooldown():
    now = [100.0]
    hosts = HostManager(lambda: {"a": 1, "b": 2}, lambda: now[0], cooldown=(10, 25))
    hosts.fail("b")
    assert hosts.usable() == {"a": 1}
    now[0] += 9.9
    assert hosts.blacklisted("b")
    now[0] += 0.2
    assert hosts.usable() == {"a": 1, "b": 2}
    hosts.fail("b")  # second failure: 20 s
    now[0] += 19.9
    assert hosts.blacklisted("b")
    now[0] += 0.2
    assert not hosts.blacklisted("b")
    hosts.fail("b")  # third: 40 s, capped at 25
    now[0] += 25.1
    assert not hosts.blacklisted("b")


def test_without_a_cooldown_a_failed_host_stays_out():
    now = [0.0]
    hosts = HostManager(lambda: {"a": 1, "b": 1}, lambda: now[0])
    hosts.fail("a")
    now[0] += 1e9
    assert hosts.usable() == {"b": 1}


def test_slots_in_host_order_capped_at_max_np():
    assert slots_of({"a": 2, "b": 1}, None) == [("a", 0), ("a", 1), ("b", 0)]
    assert slots_of({"a": 2, "b": 1}, 2) == [("a", 0), ("a", 1)]


def test_survivors_keep_their_order_and_the_oldest_is_rank_0():
    before = [("a", 0), ("b", 0), ("c", 0)]
    after = number_ranks(before, [("c", 0), ("d", 0), ("b", 0)])  # a is gone, d is new
    assert [slot for slot, _ in sorted(after.items(), key=lambda kv: kv[1].rank)] == \
        [("b", 0), ("c", 0), ("d", 0)]
    assert all(place.size == 3 for place in after.values())


def test_a_listed_twice_membership_is_refused():
    with pytest.raises(ValueError, match="lists a worker twice"):
        number_ranks([], [("a", 0), ("a", 0)])


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3)), unique=True, max_size=12),
       st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3)), unique=True, max_size=12))
def test_places_are_a_consistent_topology(previous, members):
    places = number_ranks(previous, members)
    assert sorted(p.rank for p in places.values()) == list(range(len(members)))
    for slot, place in places.items():
        same_host = sorted(q.rank for s, q in places.items() if s[0] == slot[0])
        assert place.local_size == len(same_host)
        assert place.local_rank == same_host.index(place.rank)
        same_local = sorted(q.rank for q in places.values() if q.local_rank == place.local_rank)
        assert (place.cross_rank, place.cross_size) == (same_local.index(place.rank),
                                                        len(same_local))


# The Slurm discovery (hvdmx/runner/elastic/slurm_discovery.py): sinfo's
# compact states as Slurm 22.05 prints them (`sinfo -h -N -o '%N %t'`).
SINFO = sinfo_command("n[1-6]")


@pytest.mark.parametrize("state, runs", [
    ("alloc", True), ("mix", True), ("idle", True), ("comp", True), ("resv", True),
    ("alloc$", True), ("mix@", True), ("drain", False), ("drng", False), ("down", False),
    ("down*", False), ("alloc*", False), ("fail", False), ("failg", False), ("unk", False),
    ("idle~", False), ("pow_dn", False), ("inval", False)])
def test_which_slurm_states_keep_a_node_in_the_job(state, runs):
    assert runs_jobs(state) is runs


def test_the_allocation_less_its_drained_nodes():
    hosts = [Host("n1", 2), Host("n2", 2), Host("n3", 1), Host("n4", 1)]
    # n1 twice (two partitions), n3 draining, n4 not listed at all.
    states = parse_sinfo("n1 alloc\nn2 mix\nn1 alloc\n\nn3 drng\n", SINFO)
    assert usable(hosts, states) == {"n1": 2, "n2": 2}


def test_sinfo_printing_something_else_names_the_command():
    with pytest.raises(UsageError, match=r"`sinfo -h -N -n 'n\[1-6\]' -o '%N %t'` printed the "
                       r"line 'NODELIST STATE EXTRA', not 'NODE STATE'"):
        parse_sinfo("n1 alloc\nNODELIST STATE EXTRA\n", SINFO)


def test_a_failing_sinfo_names_the_command_and_its_output(tmp_path, monkeypatch):
    # A real sinfo, pointed at an empty slurm.conf: no Slurm is needed for
    # sinfo to fail (at once; a missing file makes it retry for 60 s);
    # without sinfo installed, that is named too.
    (tmp_path / "empty.conf").write_text("")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "empty.conf"))
    with pytest.raises(UsageError, match=r"the Slurm discovery of hvdmxrun's elastic job: "
                       r"`sinfo -h -N -n n1 -o '%N %t'` (exited with status 1|could not be "
                       r"run): .*make sinfo work here"):
        SlurmDiscovery("n1", [Host("n1", 1)])()
