"""Scavenge to each added learner's first inner step, for the scavenge Decoupled runs.

    python scavenge_starts.py /tmp/cmpfull/scavenge/decoupled > scavenge_starts.txt

(the compare's run directories; learners beyond the first four are the scavenged ones)."""
import glob
import json
import sys

root = sys.argv[1]
for seed in sorted(glob.glob(f"{root}/seed*")):
    scavenge = [json.loads(line) for line in open(f"{seed}/chaos.jsonl") if '"scavenge"' in line][0]
    firsts = {}
    for path in glob.glob(f"{seed}/learners/*.events.jsonl"):
        learner = path.rsplit("/", 1)[1].split(".")[0]
        for line in open(path):
            event = json.loads(line)
            if event.get("kind") == "state" and event.get("state") == "computing":
                firsts[learner] = event["t"]
                break
    added = sorted(t - scavenge["t"] for learner, t in firsts.items() if learner not in {"L0", "L1", "L2", "L3"})
    print(seed.rsplit("/", 1)[1], f"{len(scavenge['launched'])} learners added; first inner steps "
          + ", ".join(f"{s:.2f}" for s in added) + " s later")
