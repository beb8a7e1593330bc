#!/usr/bin/env bash
# The main job, end to end on one machine: data -> Meta-IO -> (later: launch, train, deliver).
#
# Usage: PATH=.venv/bin:$PATH bash scripts/main_job.sh RUN_DIR
# Steps so far:
#   1. metaps gen-data        ~200k AntM2C-like rows (Parquet + schema.json) into RUN_DIR/data
#   2. metaps meta-io build   meta layout (tasks by user, S=8 Q=4, time split) into RUN_DIR/metaio
#   3. metaps meta-io inspect summary of what was built
set -euo pipefail

RUN_DIR="${1:?usage: main_job.sh RUN_DIR}"
ROWS="${METAPS_ROWS:-200000}"
USERS="${METAPS_USERS:-20000}"
ITEMS="${METAPS_ITEMS:-5000}"
SEED="${METAPS_SEED:-1}"

mkdir -p "$RUN_DIR"
echo "== [1/3] gen-data: $ROWS rows, $USERS users, $ITEMS items -> $RUN_DIR/data"
metaps gen-data --out "$RUN_DIR/data" --rows "$ROWS" --users "$USERS" --items "$ITEMS" --seed "$SEED"

echo "== [2/3] meta-io build (meta layout) -> $RUN_DIR/metaio"
metaps meta-io build --input "$RUN_DIR/data" --schema "$RUN_DIR/data/schema.json" \
    --out "$RUN_DIR/metaio" --layout meta --support 8 --query 4 --split time \
    --seed "$SEED" --rows-per-batch 768 --overwrite

echo "== [3/3] meta-io inspect"
metaps meta-io inspect "$RUN_DIR/metaio"
