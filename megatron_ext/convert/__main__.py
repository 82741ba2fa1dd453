"""``python -m megatron_ext.convert {to-hf,from-hf,stem-edit} ...``"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "to-hf": ("megatron_ext.convert.to_hf", "Megatron torch_dist checkpoint -> Hugging Face"),
    "from-hf": ("megatron_ext.convert.from_hf",
                "Hugging Face Llama-style checkpoint -> Megatron (optionally with STEM layers)"),
    "stem-edit": ("megatron_ext.convert.stem_edit",
                  "swap or copy the STEM rows of tokens in a Hugging Face STEM model"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
        print(f"usage: python -m megatron_ext.convert COMMAND [options]\n\n{lines}",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
