"""Tokenizer, chat templates and the incremental detokenizer, against real tokenizer fixtures."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from pagoda.tokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, Tokenizer
from tokenizer_fixtures import NAMES, tokenizer_dir

TEXTS = {
    "ascii": "def main():\n    return 42  # the answer, of course\n",
    "emoji": "Party time 🎉🎉 thumbs 👍🏽 family 👨‍👩‍👧 snake 🐍😀😀😀",
    "cjk": "你好世界，这是一个测试。日本語のテキストです。鑫龘𠀀",
    "mixed": "Ünïcödé façade — “quotes” ✓ ∑ x² 🚀 launch 火箭 at 9:00!\n\tDone.",
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello 😀, how are you?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say 你好."},
    ],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"},
    ],
]


@pytest.fixture(scope="module")
def load() -> Callable[[str], Tokenizer]:
    """Loads each fixture tokenizer once for the whole module (loading takes ~1 s each)."""
    loaded: dict[str, Tokenizer] = {}

    def load_one(name: str) -> Tokenizer:
        if name not in loaded:
            loaded[name] = Tokenizer.from_pretrained(tokenizer_dir(name))
        return loaded[name]

    return load_one


@pytest.fixture(scope="module", params=NAMES)
def tok(request: pytest.FixtureRequest, load: Callable[[str], Tokenizer]) -> Tokenizer:
    return load(request.param)


@pytest.fixture(scope="module")
def llama2(load: Callable[[str], Tokenizer]) -> Tokenizer:
    return load("llama2-spm")


@pytest.fixture(scope="module")
def llama3(load: Callable[[str], Tokenizer]) -> Tokenizer:
    return load("llama3-bpe")


def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": "Write something."}])


def text_in_context(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    """The output's text as it reads after the prompt (SentencePiece keeps a leading space)."""
    prompt_text = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def stream(detok: IncrementalDetokenizer, output: Sequence[int], chunk_sizes: Sequence[int] = (1,)) -> list[str]:
    """Feed `output` in chunks (sizes cycle through `chunk_sizes`); checks invariants per step."""
    deltas = []
    position = 0
    step = 0
    while position < len(output) and detok.stop_string is None:
        size = chunk_sizes[step % len(chunk_sizes)]
        before = detok.text
        delta = detok.add_tokens(output[position : position + size])
        assert detok.text == before + delta
        deltas.append(delta)
        position += size
        step += 1
    if detok.stop_string is None:
        before = detok.text
        tail = detok.finish()
        assert detok.text == before + tail
        deltas.append(tail)
    return deltas


def uneven_chunks(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 7) for _ in range(50)]


# -- Tokenizer ---------------------------------------------------------------------------------


def test_properties_match_the_fixture_table(tok: Tokenizer) -> None:
    expected = {
        "llama2-spm": (1, 2),
        "llama3-bpe": (128000, 128009),
        "qwen2-bpe": (None, 151645),
    }[Path(tok.hf.name_or_path).name]
    assert (tok.bos_token_id, tok.eos_token_id) == expected
    assert tok.vocab_size == len(tok.hf)
    assert tok.eos_token_id in tok.all_special_ids
    assert set(tok.hf.all_special_ids) <= tok.all_special_ids
    assert tok.has_chat_template


def test_all_special_ids_are_what_decode_skips(tok: Tokenizer) -> None:
    for token_id in sorted(tok.all_special_ids)[:20]:
        assert tok.decode([token_id], skip_special_tokens=True) == ""
        assert tok.decode([token_id], skip_special_tokens=False) != ""


def test_qwen_im_start_counts_as_special(load: Callable[[str], Tokenizer]) -> None:
    tok = load("qwen2-bpe")
    (im_start,) = tok.encode("<|im_start|>", add_special_tokens=False)
    assert im_start in tok.all_special_ids


def test_encode_and_decode_match_transformers(tok: Tokenizer) -> None:
    text = TEXTS["mixed"]
    assert tok.encode(text) == tok.hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == tok.hf(text, add_special_tokens=False)["input_ids"]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    special = max(tok.all_special_ids)
    with_special = ids[:3] + [special] + ids[3:]
    for skip in (True, False):
        assert tok.decode(with_special, skip_special_tokens=skip) == tok.hf.decode(
            with_special, skip_special_tokens=skip
        )


def test_bos_is_added_only_where_the_tokenizer_adds_it(tok: Tokenizer) -> None:
    with_specials = tok.encode("hi")
    without = tok.encode("hi", add_special_tokens=False)
    if tok.bos_token_id is not None and Path(tok.hf.name_or_path).name == "llama2-spm":
        assert with_specials == [tok.bos_token_id] + without
    assert tok.bos_token_id not in without


def test_convert_ids_to_tokens_shows_byte_fallback(llama2: Tokenizer) -> None:
    ids = llama2.encode("🎉", add_special_tokens=False)
    tokens = llama2.convert_ids_to_tokens(ids)
    assert "<0xF0>" in tokens


def test_decode_token_for_display(llama2: Tokenizer, llama3: Tokenizer) -> None:
    (hello,) = llama2.encode("Hello", add_special_tokens=False)
    assert llama2.convert_ids_to_tokens([hello]) == ["▁Hello"]
    assert llama2.decode_token(hello) == " Hello"
    (byte_f0,) = llama2.hf.convert_tokens_to_ids(["<0xF0>"])
    assert llama2.decode_token(byte_f0) == "\ufffd"
    assert llama2.decode_token(llama2.eos_token_id) == "</s>"

    world = llama3.encode(" world", add_special_tokens=False)
    assert [llama3.decode_token(i) for i in world] == [" world"]
    assert llama3.decode_token(llama3.eos_token_id) == "<|eot_id|>"
    emoji = llama3.encode(" 😀", add_special_tokens=False)
    assert "".join(llama3.decode_token(i) for i in emoji) == " 😀"


def test_bad_token_ids_raise_value_error(tok: Tokenizer) -> None:
    for bad in ([tok.vocab_size], [-1], ["7"]):
        with pytest.raises(ValueError, match="token id"):
            tok.decode(bad)
        with pytest.raises(ValueError, match="token id"):
            tok.convert_ids_to_tokens(bad)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_token(tok.vocab_size + 10)
    with pytest.raises(ValueError, match="string"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_from_pretrained_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer files"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError):
        Tokenizer.from_pretrained(tmp_path)


# -- chat templates ----------------------------------------------------------------------------


def transformers_chat_ids(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    result = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(result["input_ids"] if isinstance(result, Mapping) else result)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_matches_transformers(tok: Tokenizer, conversation: int, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conversation]
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == transformers_chat_ids(tok, messages, add_generation_prompt)
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if tok.bos_token_id is not None:
        assert ids[0] == tok.bos_token_id
        assert ids[1] != tok.bos_token_id


def test_llama3_chat_has_exactly_one_bos(llama3: Tokenizer) -> None:
    for messages in CONVERSATIONS:
        ids = llama3.encode_chat(messages)
        assert ids.count(llama3.bos_token_id) == 1
        assert ids[0] == llama3.bos_token_id


def test_llama2_chat_has_one_bos_per_user_turn(llama2: Tokenizer) -> None:
    messages = CONVERSATIONS[2]
    ids = llama2.encode_chat(messages)
    assert ids.count(llama2.bos_token_id) == 2
    assert ids[:2] != [llama2.bos_token_id, llama2.bos_token_id]


def test_generation_prompt_is_appended(tok: Tokenizer) -> None:
    messages = CONVERSATIONS[0]
    with_prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert with_prompt.startswith(without)
    if Path(tok.hf.name_or_path).name != "llama2-spm":  # its template has no generation prompt
        assert len(with_prompt) > len(without)


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "世界"}],
        }
    ]
    plain = [{"role": "user", "content": "Hello\n世界"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    assert tok.encode_chat(parts) == tok.encode_chat(plain)
    assert isinstance(parts[0]["content"], list), "the caller's messages must not be modified"


@pytest.mark.parametrize(
    "messages, message",
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "image_url",
        ),
        ([{"role": "user", "content": ["just a string"]}], "content part"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "text must be a string"),
        ([{"role": "user", "content": 5}], "string or a list"),
        ([{"content": "no role"}], "role"),
        (["not a dict"], "must be an object"),
        ([], "non-empty"),
    ],
)
def test_bad_messages_raise_value_error(llama3: Tokenizer, messages: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama3.apply_chat_template(messages)


def test_template_exception_becomes_value_error(llama2: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Only system, user and assistant"):
        llama2.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_chat_template_raises(tmp_path: Path) -> None:
    source = tokenizer_dir("llama2-spm")
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


# -- incremental detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_one_token_at_a_time_equals_full_decode(tok: Tokenizer, kind: str) -> None:
    prompt = chat_prompt(tok)
    output = tok.encode(TEXTS[kind], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, output)
    assert detok.text == text_in_context(tok, prompt, output)
    assert detok.text.lstrip(" ") == tok.decode(output).lstrip(" ")
    if Path(tok.hf.name_or_path).name != "llama2-spm":
        assert detok.text == tok.decode(output)
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(4))
def test_uneven_chunks_equal_full_decode(tok: Tokenizer, seed: int) -> None:
    prompt = chat_prompt(tok)
    output = tok.encode("".join(TEXTS.values()), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, output, uneven_chunks(seed))
    assert detok.text == text_in_context(tok, prompt, output)
    assert not any("\ufffd" in delta for delta in deltas)


def test_fixtures_really_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the tests above: they must exercise multi-byte characters spread over tokens.
    ids = tok.encode(TEXTS["emoji"] + TEXTS["cjk"], add_special_tokens=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


def test_sentencepiece_leading_space_and_empty_prompt(llama2: Tokenizer) -> None:
    output = llama2.encode("Hello world", add_special_tokens=False)
    after_text = IncrementalDetokenizer(llama2, llama2.encode("Say:"))
    stream(after_text, output)
    assert after_text.text == " Hello world"
    after_bos_only = IncrementalDetokenizer(llama2, [llama2.bos_token_id])
    stream(after_bos_only, output)
    assert after_bos_only.text == llama2.decode(output) == "Hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_mid_output(tok: Tokenizer, skip: bool) -> None:
    prompt = chat_prompt(tok)
    words = tok.encode("Hello there 😀", add_special_tokens=False)
    specials = sorted(tok.all_special_ids)[:3]
    output = words[:1] + specials + words[1:] + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    stream(detok, output)
    assert detok.text == text_in_context(tok, prompt, output, skip=skip)
    assert (tok.hf.decode([specials[0]]) in detok.text) is not skip


def test_ids_beyond_the_vocabulary_are_ignored(llama3: Tokenizer) -> None:
    output = llama3.encode("Hi there", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama3, [])
    stream(detok, output[:1] + [llama3.vocab_size + 3] + output[1:])
    assert detok.text == "Hi there"


def test_decode_window_stays_small(llama3: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    output = llama3.encode(TEXTS["mixed"] * 40, add_special_tokens=False)
    window_sizes = []
    decode_raw = llama3._decode_raw

    def recording(token_ids: list[int], skip_special_tokens: bool) -> str:
        window_sizes.append(len(token_ids))
        return decode_raw(token_ids, skip_special_tokens)

    monkeypatch.setattr(llama3, "_decode_raw", recording)
    detok = IncrementalDetokenizer(llama3, chat_prompt(llama3))
    stream(detok, output)
    assert len(output) > 500
    assert max(window_sizes) <= 12
    assert len(window_sizes) <= 3 * len(output)


def test_invalid_bytes_do_not_grow_the_window_forever(llama2: Tokenizer) -> None:
    (continuation,) = llama2.hf.convert_tokens_to_ids(["<0x80>"])
    detok = IncrementalDetokenizer(llama2, [])
    for _ in range(MAX_PENDING_TOKENS * 3):
        detok.add_tokens([continuation])
    assert detok.text and set(detok.text) == {"\ufffd"}


# -- stop strings ------------------------------------------------------------------------------


def straddles_tokens(tok: Tokenizer, ids: list[int], stop: str) -> bool:
    return not any(stop in tok.decode_token(i) for i in ids)


STOP_CASES = [
    ("The answer is forty-two. Then more text follows.", "forty-two", "The answer is "),
    ("Let us celebrate 🎉 with cake.", "🎉", "Let us celebrate "),
    ("我们找到宝藏鑫龘然后继续。", "鑫龘", "我们找到宝藏"),
]


@pytest.mark.parametrize("text, stop, before", STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunking", ["single", "uneven"])
def test_stop_string_across_tokens(
    tok: Tokenizer, text: str, stop: str, before: str, include: bool, chunking: str
) -> None:
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    chunks = (1,) if chunking == "single" else uneven_chunks(len(text))
    deltas = stream(detok, output, chunks)
    assert detok.stop_string == stop
    assert detok.text == (before + stop if include else before)
    assert "".join(deltas) == detok.text
    assert not any("\ufffd" in delta for delta in deltas)
    with pytest.raises(RuntimeError):
        detok.add_tokens(output[:1])
    assert detok.finish() == ""


def test_stop_cases_straddle_token_boundaries(tok: Tokenizer) -> None:
    for text, stop, _ in STOP_CASES:
        assert straddles_tokens(tok, tok.encode(text, add_special_tokens=False), stop) or len(stop) == 1, (text, stop)


def test_withheld_tail_is_released_by_finish(tok: Tokenizer) -> None:
    text = "Counting: one two thr"
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["three", "x"])
    seen = []
    for token_id in output:
        detok.add_tokens([token_id])
        seen.append(detok.text)
        assert "thr" not in detok.text
    assert detok.text == "Counting: one two "
    assert detok.finish() == "thr"
    assert detok.text == text
    assert detok.stop_string is None
    assert all(text.startswith(prefix) for prefix in seen)


def test_withholding_releases_once_the_tail_cannot_be_a_stop(llama3: Tokenizer) -> None:
    detok = IncrementalDetokenizer(llama3, [], stop=["three"])
    detok.add_tokens(llama3.encode("one t", add_special_tokens=False))
    assert detok.text == "one "
    detok.add_tokens(llama3.encode("wo", add_special_tokens=False))
    assert detok.text == "one two"


def test_include_stop_str_in_output_withholds_nothing(llama3: Tokenizer) -> None:
    text = "Counting: one two thr"
    detok = IncrementalDetokenizer(llama3, [], stop=["three"], include_stop_str_in_output=True)
    detok.add_tokens(llama3.encode(text, add_special_tokens=False))
    assert detok.text == text
    assert detok.finish() == ""


def test_stop_in_the_middle_of_a_token_releases_nothing_after_it(llama3: Tokenizer) -> None:
    output = llama3.encode("Hello world, friends", add_special_tokens=False)
    excluded = IncrementalDetokenizer(llama3, [], stop=["o w"])
    stream(excluded, output)
    assert excluded.text == "Hell"
    included = IncrementalDetokenizer(llama3, [], stop=["o w"], include_stop_str_in_output=True)
    stream(included, output)
    assert included.text == "Hello w"


@pytest.mark.parametrize("stops", [["beta", "alpha"], ["alpha", "beta"]])
@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_wins(tok: Tokenizer, stops: list[str], chunk: int) -> None:
    output = tok.encode("x alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    stream(detok, output, (chunk,))
    assert detok.stop_string == "alpha"
    assert detok.text == "x "


@pytest.mark.parametrize("chunk", [1, 100])
def test_stop_completing_first_wins_whatever_the_chunking(llama3: Tokenizer, chunk: int) -> None:
    # "bc" completes before "abcd" does; "abc" and "bc" complete together and "abc" starts first.
    output = llama3.encode("xabcd", add_special_tokens=False)
    first_to_complete = IncrementalDetokenizer(llama3, [], stop=["abcd", "bc"])
    stream(first_to_complete, output, (chunk,))
    assert (first_to_complete.stop_string, first_to_complete.text) == ("bc", "xa")
    tie = IncrementalDetokenizer(llama3, [], stop=["bc", "abc"])
    stream(tie, output, (chunk,))
    assert (tie.stop_string, tie.text) == ("abc", "x")


def test_stop_string_split_over_calls_with_no_text_in_between(llama3: Tokenizer) -> None:
    detok = IncrementalDetokenizer(llama3, [], stop=["END"])
    assert detok.add_tokens(llama3.encode("data E", add_special_tokens=False)) == "data "
    assert detok.add_tokens(llama3.encode("N", add_special_tokens=False)) == ""
    assert detok.add_tokens(llama3.encode("D tail", add_special_tokens=False)) == ""
    assert (detok.stop_string, detok.text) == ("END", "data ")


def test_stop_at_the_very_start(llama3: Tokenizer) -> None:
    detok = IncrementalDetokenizer(llama3, [], stop=["Hi"], include_stop_str_in_output=False)
    assert detok.add_tokens(llama3.encode("Hi there", add_special_tokens=False)) == ""
    assert detok.stop_string == "Hi" and detok.text == ""


def test_finish_is_final(llama3: Tokenizer) -> None:
    detok = IncrementalDetokenizer(llama3, [], stop=["zz"])
    detok.add_tokens(llama3.encode("abc z", add_special_tokens=False))
    assert detok.finish() == "z"
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None]])
def test_empty_stop_string_is_rejected(llama3: Tokenizer, stop: list) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(llama3, [], stop=stop)
