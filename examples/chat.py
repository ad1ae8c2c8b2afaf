"""A chat loop over an exported artifact, on any of its target's runtimes.

Each line you type is one question, put in the chat template the artifact's tokenizer carries
(`oscar-export run --chat` does the same for one question). Questions are answered one at a time,
without the earlier turns. For example, with the real model at hand:

    SMOL="$(bash scripts/fetch_smollm2.sh)"
    .venv/bin/oscar-export --target laptop --model "$SMOL" --out smollm2-laptop
    .venv/bin/python examples/chat.py --artifact smollm2-laptop                # ONNX Runtime, native op
    .venv/bin/python examples/chat.py --artifact smollm2-laptop --runtime reference
"""

import argparse

from oscar_export.run import run_artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="directory written by oscar-export --target")
    parser.add_argument("--runtime", help="one of the target's runtimes (default: its first)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    while True:
        try:
            question = input("you> ").strip()
        except EOFError:
            break
        if question:
            answer = run_artifact(args.artifact, question, args.max_new_tokens, args.runtime, chat=True)
            print("model>", answer["text"].strip())


if __name__ == "__main__":
    main()
