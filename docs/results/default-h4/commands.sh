#!/usr/bin/env bash
# The runs of README.md (one after another, about 2 min each on 2 cores). The flags are
# spelled out, so they mean the same before and after the defaults changed.
R=docs/results/default-h4/run.sh
SP8="--delta-codec sparse --delta-density 0.125 --reply-codec sparse --reply-density 1"
$R base-h8-s0 --seed 0 --sync-every 8 --delta-codec int4 --reply-codec int4 --inner-optimizer adamw
for s in 0 1 2; do
  $R sp8h4-s$s --seed $s --sync-every 4 $SP8 --inner-optimizer adamw
  $R sp8h4p-s$s --seed $s --sync-every 4 $SP8 --inner-optimizer adamw-pooled
done
$R sp16h2-s0 --seed 0 --sync-every 2 --delta-codec sparse --delta-density 0.0625 --reply-codec sparse --reply-density 1 --inner-optimizer adamw
# longer (8x the standard tokens), the new defaults spelled out:
TOKENS="--tokens 7864320" $R longer-s0 --seed 0 --sync-every 4 $SP8 --inner-optimizer adamw-pooled
for s in 1 2; do TOKENS="--tokens 7864320" $R longer-s$s --seed $s --sync-every 4 $SP8 --inner-optimizer adamw-pooled; done
# DP's third longer run (its seeds 0 and 1: ../long/longer/, ../outer/longer-dp-s1/):
python -m diloco compare --workload longer --scenario nofault --systems dp --seeds 1 --seed 2 --out runs/longer-dp-s2
