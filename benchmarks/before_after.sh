#!/bin/bash
# Performance side by side: a tree before a change and this one, alternated (the order swapped each
# pair), PAIRS pairs, each side importing its own src/ through PYTHONPATH (same venv, same torch):
#   1,024 batched D-PSGD nodes (digits, mlp, regular:3, 100 iterations): wall and CPU (/usr/bin/time);
#   the FedAvg job (batched, 100 clients, Fashion-MNIST, mlp, 20 iterations of 10 steps): wall and CPU;
#   resnet18 averaging (process engine, 4 nodes on a ring, CIFAR-10): the median "average" phase.
# usage: benchmarks/before_after.sh OLD_TREE DATASETS_DIR OUT [PAIRS]   (from the repository root)
#   e.g. git worktree add /tmp/old 44ecde0 && benchmarks/before_after.sh /tmp/old ../shared/datasets /tmp/perf 3
set -u
OLD=$1; DATA=$2; OUT=$3; PAIRS=${4:-3}; NEW=$(pwd); mkdir -p "$OUT/runs"
CIFAR=cifar10:$DATA/cifar10-jpeg.tar.gz
FMNIST=fashion-mnist:$DATA/fashion-mnist
run() { # label tree command...
  local label=$1 src=$2; shift 2
  /usr/bin/time -f "$label wall %e user %U sys %S maxrss_kb %M" -o "$OUT/time.tmp" env PYTHONPATH="$src/src" "$@" \
      > "$OUT/$label.log" 2>&1
  cat "$OUT/time.tmp" >> "$OUT/results.txt"
  grep -E "^average|accuracy" "$OUT/$label.log" | head -2 | sed "s/^/$label: /" >> "$OUT/results.txt"
}
for pair in $(seq 1 "$PAIRS"); do
  order="old new"; [ $((pair % 2)) = 0 ] && order="new old"
  for side in $order; do
    src=$OLD; [ "$side" = new ] && src=$NEW
    run "b1024-$side-$pair" "$src" python -m meshlearn simulate --engine batched --nodes 1024 --topology regular:3 \
        --iterations 100 --test-after 50 --quiet --output "$OUT/runs/b1024-$side-$pair"
    run "fedavg-$side-$pair" "$src" python -m meshlearn simulate --engine batched --algorithm fedavg --nodes 100 \
        --dataset "$FMNIST" --model mlp --iterations 20 --rounds 10 --batch-size 32 --lr 0.05 --test-after 20 \
        --quiet --output "$OUT/runs/fedavg-$side-$pair"
    run "r18-$side-$pair" "$src" python benchmarks/iteration.py --dataset "$CIFAR" --model resnet18 --nodes 4 \
        --topology ring --iterations 8 --rounds 1 --batch-size 8 --test-after 100 --eval-samples 100 \
        --output "$OUT/runs/r18-$side-$pair"
  done
done
