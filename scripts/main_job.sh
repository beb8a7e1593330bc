#!/usr/bin/env bash
# The main job, end to end on one machine (what `make run` does):
#
#   1. metaps gen-data              AntM2C-like logs (Parquet + schema.json)      -> RUN_DIR/data
#   2. metaps meta-io split-holdout 10% of users held out (never trained on)      -> RUN_DIR/split
#   3. metaps meta-io build (x2)    task-packed Meta-IO: train and held-out eval  -> RUN_DIR/metaio[-holdout]
#   4. metaps launch                controller + 2 PS + 2 workers, G-Meta CTR/CVR training, with a
#                                   straggler scheduled ([[faults.faults]]); its summary says what fired
#                                   and what the controller did (report.json `faults`, controller events)
#   5. metaps deliver               the run's checkpoint -> a published serving bundle (gated on AUC)
#
# Usage: PATH=.venv/bin:$PATH bash scripts/main_job.sh RUN_DIR
# Sizes: METAPS_ROWS, METAPS_USERS, METAPS_ITEMS, METAPS_SEED (run time of the defaults: README, "What `make run` does").
# The job file is configs/main_job.toml; its data paths are rewritten to RUN_DIR here.
set -euo pipefail

RUN_DIR="${1:?usage: main_job.sh RUN_DIR}"
ROWS="${METAPS_ROWS:-60000}"
USERS="${METAPS_USERS:-6000}"
ITEMS="${METAPS_ITEMS:-3000}"
SEED="${METAPS_SEED:-1}"
CONFIG="${METAPS_CONFIG:-configs/main_job.toml}"

mkdir -p "$RUN_DIR"
rm -rf "$RUN_DIR/data" "$RUN_DIR/split"
echo "== [1/5] gen-data: $ROWS rows, $USERS users, $ITEMS items -> $RUN_DIR/data"
metaps gen-data --out "$RUN_DIR/data" --rows "$ROWS" --users "$USERS" --items "$ITEMS" --seed "$SEED"

echo "== [2/5] split-holdout: 10% of users held out -> $RUN_DIR/split"
metaps meta-io split-holdout --input "$RUN_DIR/data" --schema "$RUN_DIR/data/schema.json" \
    --out "$RUN_DIR/split" --fraction 0.1 --seed "$SEED"

echo "== [3/5] meta-io build (meta layout, S=8 Q=4, time split) -> $RUN_DIR/metaio, $RUN_DIR/metaio-holdout"
for part in train holdout; do
    out="$RUN_DIR/metaio"; [[ $part == holdout ]] && out="$RUN_DIR/metaio-holdout"
    metaps meta-io build --input "$RUN_DIR/split/$part" --schema "$RUN_DIR/split/schema.json" \
        --out "$out" --layout meta --support 8 --query 4 --split time \
        --seed "$SEED" --rows-per-batch 256 --overwrite
done
metaps meta-io inspect "$RUN_DIR/metaio"

echo "== [4/5] launch: controller, 2 PS, 2 workers (a straggler fault is scheduled: what fired is reported below)"
metaps config-write --config "$CONFIG" --out "$RUN_DIR/job.toml" \
    --set "data.train=$RUN_DIR/metaio" --set "data.eval=$RUN_DIR/metaio-holdout" \
    --set "run.dir=$RUN_DIR/runs" --set "delivery.out=$RUN_DIR/bundles"
metaps launch --config "$RUN_DIR/job.toml" --no-progress --timeout 900

echo "== [5/5] deliver: latest checkpoint -> serving bundle"
rc=0
# each `make run` is a new run: its checkpoint is due whatever its step (steps compare within a
# run only); the AUC gate decides whether it replaces the bundle the last run published
metaps deliver --run "$RUN_DIR/runs/latest" --out "$RUN_DIR/bundles" \
    --holdout "$RUN_DIR/split/holdout" --holdout-rows 20000 --keep 5 || rc=$?
if [[ $rc == 3 ]]; then
    # a rerun of `make run` is gated against the bundle the previous run published: a refusal is
    # the gate doing its job (the published bundle stays), not a failure of the job
    echo "deliver: the AUC gate refused this run's bundle; $RUN_DIR/bundles keeps the published one"
elif [[ $rc != 0 ]]; then
    exit "$rc"
fi

# the run's own directory, relative to the repo like every other path printed here
run="$RUN_DIR/runs/$(basename "$(readlink "$RUN_DIR/runs/latest")")"
latest="$RUN_DIR/bundles/$(cat "$RUN_DIR/bundles/LATEST")"
python - "$run/report.json" <<'PY'
import json, sys
from metaps.run_report import controller_text, faults_text, workers_text
rep = json.load(open(sys.argv[1]))
print()
for line in (faults_text(rep), controller_text(rep), workers_text(rep)):
    if line:
        print(line)
PY
echo
echo "AUC key: the launch's AUC table and cold-start lines score episodes of the Meta-IO holdout"
echo "  ($RUN_DIR/metaio-holdout): base = no adaptation, adapted = after the inner loop on each task's"
echo "  support rows, query rows scored. deliver's 'holdout AUC' scores the raw holdout"
echo "  ($RUN_DIR/split/holdout) first-k per user with the adaptation it chose; its 'mean AUC' is the"
echo "  mean over both heads on the validation episodes it chose that adaptation on."
echo
echo "run report : $run/report.json"
echo "summary    : $run/plots/summary.png (also throughput.png, loss.png, auc.png, shards.png)"
echo "tensorboard: tensorboard --logdir $run/tb"
echo "bundle     : $latest"
echo "predict    : metaps predict --bundle $RUN_DIR/bundles --data $RUN_DIR/split/holdout --out $RUN_DIR/scores.parquet"
