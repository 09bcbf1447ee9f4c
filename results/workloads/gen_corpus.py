"""A 2 GB text corpus: WikiText-2's training lines, shuffled with a recorded seed, again and again."""
import random, sys
from blocktrain.blocks.data import read_embedded
lines = read_embedded("train").split(b"\n")
target, seed = int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
n = 0
with open(sys.argv[1], "wb") as f:
    while n < target:
        rng.shuffle(lines)
        blob = b"\n".join(lines) + b"\n"
        blob = blob[: target - n]
        f.write(blob)
        n += len(blob)
print(n)
