"""Conversations for chat fine-tuning made from the Shakespeare corpus (docs/training.md's worked
example): a speech that ends in a question as the user's message, the next speaker's speech as the
assistant's reply, both under 200 characters; as JSON lines of `messages`, the first N (400).

    python bench/shakespeare_chat.py data/tinyshakespeare.txt chat.jsonl [N]
"""
import json
import sys


def main():
    corpus, out = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    speeches = [s.strip() for s in open(corpus).read().split("\n\n") if s.strip()]
    lines = []
    for question, answer in zip(speeches, speeches[1:]):
        q, a = question.split("\n", 1), answer.split("\n", 1)
        if len(q) < 2 or len(a) < 2 or not q[1].endswith("?") or len(q[1]) > 200 or len(a[1]) > 200:
            continue
        lines.append({"messages": [{"role": "user", "content": q[1]}, {"role": "assistant", "content": a[1]}]})
    with open(out, "w") as f:
        for line in lines[:n]:
            f.write(json.dumps(line) + "\n")
    print(f"{min(n, len(lines))} conversations of {len(lines)} in {out}")


if __name__ == "__main__":
    main()
