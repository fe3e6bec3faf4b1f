#!/usr/bin/env bash
# CPU quickstart, end to end: build a corpus from the Python standard library's own text (offline),
# train a sentencepiece tokenizer, preprocess to Megatron .bin/.idx, train a small GPT-MoE
# (4 layers, 8 experts, top-2) on 2 processes with expert parallelism 2, stop at iteration 50
# with a checkpoint, then resume from it to iteration 100.
#
#   bash examples/quickstart_cpu.sh [WORK_DIR]          (default: runs/quickstart)
#   PYTHON=python3.12 VENV=.venv312 bash examples/quickstart_cpu.sh   # another Python: its own venv
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$ROOT/runs/quickstart}"
bash "$ROOT/scripts/setup_env.sh"   # PYTHON= / VENV= select the interpreter and venv
VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
mkdir -p "$WORK/data"
cd "$ROOT"

if [ ! -f "$WORK/data/corpus_text_document.idx" ]; then
  "$PY" tools/make_corpus.py --output "$WORK/corpus.jsonl"
  "$PY" tools/train_tokenizer.py --input "$WORK/corpus.jsonl" --model-prefix "$WORK/tokenizer" \
      --vocab-size 4000 --model-type bpe
  "$PY" tools/preprocess_data.py --input "$WORK/corpus.jsonl" --json-keys text \
      --output-prefix "$WORK/data/corpus" --tokenizer-type SentencePieceTokenizer \
      --tokenizer-model "$WORK/tokenizer.model" --workers 2 --append-eod
fi

# Megatron-style positional arguments: checkpoint path, tokenizer model, data path.
PYTHON="$PY" bash examples/train_gpt_moe_cpu.sh "$WORK/checkpoints" "$WORK/tokenizer.model" \
    "$WORK/data/corpus_text_document" --exit-interval 50
echo "=== stopped at iteration 50; resuming from $WORK/checkpoints ==="
PYTHON="$PY" bash examples/train_gpt_moe_cpu.sh "$WORK/checkpoints" "$WORK/tokenizer.model" \
    "$WORK/data/corpus_text_document"
