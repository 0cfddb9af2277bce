"""Snapshots in object storage: a real S3-compatible server (moto's server mode, started
here on 127.0.0.1) and s3fs, through the same code that writes local directories.

One ``diloco local`` run takes scheduled snapshots into ``s3://`` and keeps the newest
two; shard 0 is SIGKILLed mid-run and restored from a snapshot read back from the bucket;
the run replays bit for bit from the bucket. Then ``--restore latest`` is checked against
the bucket: a tampered file or manifest is refused with its reason, before anything is
restored."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
from moto import server as moto_server

from diloco import snapshots
from diloco.errors import FailedPrecondition, NotFound

pytestmark = pytest.mark.cluster


TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]
BUCKET = "diloco-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 and the environment every process of a run gets."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # for this process's s3fs (the test's own checks)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs, {**os.environ, **env}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def test_snapshot_storage_on_s3_lists_only_complete_snapshots_and_deletes_whole_ones(s3):
    fs, _ = s3
    root = f"s3://{BUCKET}/unit"
    for snapshot_id, complete in ((1, True), (2, False), (3, True)):
        directory = snapshots.snapshot_path(root, snapshot_id)
        snapshots.write_file(snapshots.join(directory, "S0-state.npz"), b"state %d" % snapshot_id)
        if complete:
            snapshots.write_file(snapshots.join(directory, snapshots.MANIFEST), b"{}")
    assert snapshots.snapshot_ids(root) == {1: True, 2: False, 3: True}
    assert snapshots.find_manifest(root, "latest") == f"{root}/000003/manifest.json"
    with pytest.raises(NotFound, match="snapshot 2 .* never completed"):
        snapshots.find_manifest(root, "2")
    assert snapshots.read_file(f"{root}/000001/S0-state.npz") == b"state 1"
    snapshots.remove_snapshot(root, 3)
    assert snapshots.snapshot_ids(root) == {1: True, 2: False}
    assert not fs.exists(f"{BUCKET}/unit/000003/S0-state.npz")
    with pytest.raises(NotFound):
        snapshots.read_file(f"{root}/000003/S0-state.npz")


@pytest.fixture(scope="module")
def s3_run(s3, tmp_path_factory):
    fs, env = s3
    out = tmp_path_factory.mktemp("s3run") / "run"
    url = f"s3://{BUCKET}/run1/snapshots"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps", "3000",
         "--batch-size", "8", "--snapshot-dir", url, "--snapshot-every-s", "2", "--snapshot-keep", "2",
         "--restart-shard-at", "8", "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, url, fs


def test_scheduled_snapshots_go_to_s3_and_only_the_newest_two_are_kept(s3_run):
    out, url, fs = s3_run
    stored = snapshots.snapshot_ids(url)
    complete = [i for i, done in stored.items() if done]
    # Several were taken (every 2 s over a run of more than 8 s), the older ones deleted.
    log = (out / "logs" / "coordinator.log").read_text()
    taken = log.count("scheduled snapshot (every 2 s)")
    assert taken >= 3, log[-2000:]
    assert "deleted snapshots" in log
    # Kept: the newest two complete, and the one shard 0 was restored from (pinned: replaying
    # its tape starts there). Everything older is gone, unfinished ones included.
    (restart,) = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    restored = restart["snapshot"]
    assert snapshots.pins(url, restored) == ["S0"]
    newest_two = sorted(complete)[-2:]
    assert set(complete) == {*newest_two, restored}, stored
    assert [i for i in stored if i < newest_two[-1] and i not in complete] == [], stored
    for snapshot_id in complete:
        manifest_url = snapshots.find_manifest(url, str(snapshot_id))
        manifest = snapshots.read_manifest(manifest_url, (out / "secret").read_text().strip())
        names = {e["participant"]: e for e in manifest["files"]}
        assert {"S0", "S1"} <= set(names)
        for participant in ("S0", "S1"):
            files = snapshots.files_of(manifest_url, manifest, participant)  # sizes and SHA-256 verified
            assert set(files) == {f"{participant}-state.npz", f"{participant}-channel.npz"}


def test_a_shard_restored_from_s3_mid_run_replays_bit_for_bit(s3_run, s3):
    out, url, _ = s3_run
    _, env = s3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["shard_restarts"] == 1
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5
    (restart,) = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "restart_shard"]
    assert restart["snapshot"] >= 1
    shard_log = (out / "logs" / "shard0.log").read_text()
    assert f"restoring shard 0 from snapshot {restart['snapshot']} ({url}/{restart['snapshot']:06d}/manifest.json)" in shard_log
    replay = subprocess.run([sys.executable, "-m", "diloco", "replay", str(out), "--snapshot-dir", url, "--check"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    # Shard 0 was replayed from the snapshot it came back from, and rounds were replayed
    # after it (a replay of nothing would also differ by nothing).
    replayed = re.search(rf"shard 0: replayed (\d+) rounds from snapshot {restart['snapshot']};", replay.stdout)
    assert replayed and int(replayed.group(1)) > 0, replay.stdout
    assert "max absolute difference from the run's final global parameters: 0\n" in replay.stdout, replay.stdout


def _restore(out, url, env, spec="latest"):
    """A shard process asked to --restore from the bucket; it exits at once when refused."""
    return subprocess.run(
        [sys.executable, "-m", "diloco", "--tls-dir", str(out / "tls"), "syncer", "--shard-id", "0", "--shards", "2", "--port", "0",
         "--secret-file", str(out / "secret"), "--run-config", str(out / "run.json"),
         "--snapshot-dir", url, "--restore", spec],
        capture_output=True, text=True, timeout=60, env=env,
    )


def test_a_tampered_snapshot_in_s3_is_refused_with_its_reason(s3_run, s3):
    out, url, fs = s3_run
    _, env = s3
    from diloco.syncer.snapshot import load_for_restore

    secret = (out / "secret").read_text().strip()
    latest = max(i for i, done in snapshots.snapshot_ids(url).items() if done)
    snapshot_id, state, _ = load_for_restore("latest", url, 0, secret)  # intact: restores
    assert snapshot_id == latest and state["fragments"]

    key = f"{BUCKET}/run1/snapshots/{latest:06d}/S0-state.npz"
    original = fs.cat_file(key)
    fs.pipe_file(key, original[:-1] + bytes([original[-1] ^ 1]))  # one bit flipped
    try:
        with pytest.raises(FailedPrecondition, match="S0-state.npz does not match its checksum"):
            load_for_restore("latest", url, 0, secret)
        refused = _restore(out, url, env)
        assert refused.returncode == 2 and "does not match its checksum" in refused.stderr
        assert "Traceback" not in refused.stderr and "listening" not in refused.stdout + refused.stderr
    finally:
        fs.pipe_file(key, original)
    assert hashlib.sha256(fs.cat_file(key)).hexdigest() == hashlib.sha256(original).hexdigest()

    manifest_key = f"{BUCKET}/run1/snapshots/{latest:06d}/manifest.json"
    manifest = json.loads(fs.cat_file(manifest_key))
    forged = {**manifest, "coordinator_clock": {**manifest["coordinator_clock"], "C": 10**6}}
    fs.pipe_file(manifest_key, json.dumps(forged).encode())
    try:
        refused = _restore(out, url, env)
        assert refused.returncode == 2 and "not authenticated by this run's secret" in refused.stderr
    finally:
        fs.pipe_file(manifest_key, json.dumps(manifest).encode())
