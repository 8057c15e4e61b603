"""The pure helpers of tools/two_hosts.py (no namespaces, no processes): rate parsing,
names, tbf options, the cross-host byte models and the alpha-beta fit."""


import pytest

import two_hosts  # (tools/, on pytest.ini's pythonpath)

HOSTS_2X2 = {0: "a", 1: "a", 2: "b", 3: "b"}


@pytest.mark.parametrize("text, bytes_per_s", [
    ("100mbit", 12.5e6), ("1gbit", 125e6), ("500kbit", 62.5e3), ("2.5MBit", 312.5e3),
    ("10mbps", 10e6)])
def test_parse_rate(text, bytes_per_s):
    assert two_hosts.parse_rate(text) == pytest.approx(bytes_per_s)


def test_no_rate():
    assert two_hosts.parse_rate("none") is None and two_hosts.parse_rate(None) is None


@pytest.mark.parametrize("text", ["100", "fast", "mbit", "-1mbit", "100 mbit"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError, match="expected a number"):
        two_hosts.parse_rate(text)


def test_names_fit_interfaces_and_round_trip():
    hosts = two_hosts.hosts_for("4194304")  # the largest pid
    assert [h.ip for h in hosts] == list(two_hosts.IPS)
    assert all(len(h.device) <= 15 for h in hosts)
    assert len({h.namespace for h in hosts} | {h.device for h in hosts}) == 4
    assert [two_hosts.tag_of(h.namespace) for h in hosts] == ["4194304"] * 2
    assert two_hosts.tag_of("someone_elses") is None
    with pytest.raises(ValueError, match="tag"):
        two_hosts.hosts_for("12345678")


def test_tbf_burst_holds_an_offload_frame_and_4ms():
    args = two_hosts.tbf_args("100mbit")
    assert args[:2] == ["rate", "100mbit"]
    assert int(args[args.index("burst") + 1]) == 64 * 1024
    assert int(two_hosts.tbf_args("10gbit")[3]) == int(1.25e9 * 0.004)


def test_ring_cross_bytes_counts_successors_on_the_other_host():
    world = [0, 1, 2, 3]
    sent = [two_hosts.ring_cross_bytes(100, world, r, HOSTS_2X2) for r in world]
    assert sent == [0, 100, 0, 100]  # 1 -> 2 and 3 -> 0 cross
    assert two_hosts.ring_cross_bytes(100, [0, 2], 2, HOSTS_2X2) == 100  # outer pair
    assert two_hosts.ring_cross_bytes(100, [0, 1], 0, HOSTS_2X2) == 0  # inner pair
    assert two_hosts.ring_cross_bytes(100, [3], 3, HOSTS_2X2) == 0


def test_gloo_reduce_scatter_model():
    world = [0, 1, 2, 3]
    payload = 1600.0
    sent = sum(two_hosts.gloo_reduce_scatter_cross_bytes(payload, world, r, HOSTS_2X2)
               for r in world)
    ring = sum(two_hosts.ring_cross_bytes(3 / 4 * payload, world, r, HOSTS_2X2) for r in world)
    assert ring == 1.5 * payload
    assert sent == pytest.approx(2 * payload)  # ring part 1.5, pieces to owners 0.5
    inner = two_hosts.gloo_reduce_scatter_cross_bytes(payload, [0, 1], 0, HOSTS_2X2)
    assert inner == 0.0
    # two ranks on two hosts (HFSDP's outer group) exchange slices: a ring's bytes
    outer = [0, 2]
    assert sum(two_hosts.gloo_reduce_scatter_cross_bytes(payload, outer, r, HOSTS_2X2)
               for r in outer) == sum(two_hosts.ring_cross_bytes(payload / 2, outer, r,
                                                                  HOSTS_2X2) for r in outer)


def test_payload_and_alpha_beta():
    assert two_hosts.payload_bytes(1514 * 10 + 66 * 5, 15) == 1448 * 10
    fit = two_hosts.alpha_beta(0.001, 0.801, 8e6)
    assert fit["alpha_s"] == 0.001
    assert fit["beta_bytes_per_s"] == pytest.approx(1e7)


def test_without_root_or_iproute2_the_cli_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(two_hosts, "missing_requirements", lambda need_tc: ["not root: x"])
    assert two_hosts.main(["up", "100mbit", "--tag", "t"]) == two_hosts.EXIT_UNAVAILABLE
    assert "not root" in capsys.readouterr().err
    assert two_hosts.main(["down", "--tag", "t"]) == two_hosts.EXIT_UNAVAILABLE
