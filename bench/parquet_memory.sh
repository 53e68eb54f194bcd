#!/usr/bin/env bash
# Peak memory of reading a large parquet file: gpt-train tokenises a ~1 GB parquet corpus (a
# `text` column, written by pyarrow in row groups of 10 000 rows) into its token cache, with no
# training step; /usr/bin/time reports the peak resident memory. The text is tinyshakespeare's
# paragraphs repeated, so a character tokenizer made from tinyshakespeare covers it.
#   [GB=1] bash bench/parquet_memory.sh [PYTHON]          (PYTHON: one with pyarrow)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
gb=${GB:-1}
out=target/parquet-memory
mkdir -p "$out"
cargo build -q --release --locked -p gpt-train
if [ ! -f "$out/big-$gb.parquet" ]; then
  "$python" - "$out/big-$gb.parquet" "$gb" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
path, gb = sys.argv[1], float(sys.argv[2])
paragraphs = [p for p in open("data/tinyshakespeare.txt").read().split("\n\n") if p]
target = int(gb * 1e9)
writer = pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="snappy")
written, i = 0, 0
while written < target:
    rows = [paragraphs[(i + j) % len(paragraphs)] for j in range(10_000)]
    i += 10_000
    written += sum(len(r) for r in rows)
    writer.write_table(pa.table({"text": rows}), row_group_size=10_000)
writer.close()
print(f"{path}: {written / 1e9:.2f} GB of text")
PY
fi
./target/release/gpt-train tokenizer --kind char --data data/tinyshakespeare.txt --out "$out/tok" >/dev/null
rm -rf "$out/run"
/usr/bin/time -f "peak %M KB, wall %e s" ./target/release/gpt-train train --data "$out/big-$gb.parquet" \
  --out "$out/run" --tokenizer "$out/tok/tokenizer.json" --device cpu --max-iters 0 --eval-iters 1 \
  --n-layer 1 --n-head 1 --n-embd 16 --block-size 16 2>&1 | grep -E "peak|tokenised" || true
ls -l "$out/big-$gb.parquet" "$out/run/tokens/train.bin"
