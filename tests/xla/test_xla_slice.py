"""A multi-host slice's protocol with XLA hosts: leader and follower each train on 4 PJRT
CPU devices (each its own mesh here; on a TPU slice the hosts share one), and the
follower's repeated writes (replies written into split parameters, split again) leave it
with the leader's model bit for bit."""

from tests.checks import assert_same_tensors
from tests.cluster.test_slice import run_slice, shard  # noqa: F401  (shard: the fixture)


def test_xla_hosts_of_a_slice_end_with_one_model(tmp_path, shard):  # noqa: F811
    hosts = run_slice(tmp_path, shard, steps=40, device="xla")
    leader, follower = hosts[0]["summary"], hosts[1]["summary"]
    assert leader["replies_applied"] > 0 and leader["inner_steps"] == follower["inner_steps"] == 40, (leader, follower)
    assert_same_tensors(list(hosts[1]["model"].values()), list(hosts[0]["model"].values()), "the follower's model")
