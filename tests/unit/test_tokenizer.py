"""Our GGUF-built tokenizer and chat template against Hugging Face's for the same GGUF file, and
the streaming detokenizer against a full decode."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from goodserve.errors import InvalidRequestError
from goodserve.model.detokenizer import IncrementalDetokenizer
from goodserve.model.tokenizer import Tokenizer, read_chat_template
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import embedded_gguf_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    path = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


TEXTS = [
    "Hello, world!",
    "def add(a, b):\n\treturn a + b  # sum\n",
    "Prices: 1234567 and 3.14159, phone 555-0199, year 2024",
    "   leading spaces, trailing tabs\t\t\n\n\nand   runs     of      blanks   ",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🤖🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>goodserve<file_sep>x = [i**2 for i in range(10)]",
    "don't won't it's we've I'm you'll they'd",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok: Tokenizer, hf_tok, text: str):
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(tok: Tokenizer, hf_tok, text: str, skip: bool):
    ids = hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_digits_are_single_tokens(tok: Tokenizer):
    # SmolLM's pre-tokenizer splits every digit; "2024" must be four tokens.
    ids = tok.encode("2024", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]


def test_special_ids_and_vocab(tok: Tokenizer, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.eos_token_ids == [hf_tok.eos_token_id]
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.id_to_token(tok.eos_token_ids[0]) == "<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 日本? 🤖"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok: Tokenizer, hf_tok, messages, add_generation_prompt: bool):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref


CONTINUED = [
    [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}],
    [{"role": "user", "content": "List three primes:"}, {"role": "assistant", "content": "2, 3, "}],  # trailing space
    [{"role": "user", "content": "Write a haiku about"}],  # a user turn continued
]


@pytest.mark.parametrize("messages", CONTINUED)
def test_continue_final_message_matches_hf(tok: Tokenizer, hf_tok, messages):
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                     tokenize=False)
    assert ours == ref
    assert not ours.endswith("<|im_end|>\n")


def test_continue_final_message_refuses_what_it_cannot_continue(tok: Tokenizer):
    last = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(InvalidRequestError, match="add_generation_prompt to false"):
        tok.apply_chat_template(last, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="text to continue"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                                add_generation_prompt=False, continue_final_message=True)
    rewriting = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2],
                          chat_template="{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="changed the last message"):
        rewriting.apply_chat_template(last, add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template_and_only_its_own_variables_pass(tok: Tokenizer):
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[-1]['content'] }}"
    thinking = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], chat_template=template)
    messages = [{"role": "user", "content": "x"}]
    thinking.check_template_kwargs({"enable_thinking": True})
    assert thinking.apply_chat_template(messages, enable_thinking=True) == "<think>x"
    assert thinking.apply_chat_template(messages, enable_thinking=False) == "x"
    with pytest.raises(InvalidRequestError, match="'enable_reasoning' is not a variable.*enable_thinking"):
        thinking.check_template_kwargs({"enable_reasoning": True})
    for server_set in ("messages", "add_generation_prompt", "tools"):
        with pytest.raises(InvalidRequestError, match=f"may not set '{server_set}'"):
            thinking.check_template_kwargs({server_set: []})
    with pytest.raises(InvalidRequestError, match="'enable_thinking' is not a variable.*none"):
        tok.check_template_kwargs({"enable_thinking": True})  # SmolLM2's template reads none
    # Unread, a variable is undefined, which the template takes as false: a false value changes nothing
    # the client did not ask for, so it passes (vLLM's clients send enable_thinking=false to every model).
    tok.check_template_kwargs({"enable_thinking": False, "reasoning": None})
    assert thinking.apply_chat_template(messages) == thinking.apply_chat_template(messages, enable_thinking=False)


PLAIN_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_read_chat_template_takes_a_file_or_the_template_and_refuses_what_is_neither(tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    assert read_chat_template(str(path)) == PLAIN_TEMPLATE == read_chat_template(PLAIN_TEMPLATE)
    with pytest.raises(InvalidRequestError, match="no file .*missing.jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError, match="not a valid Jinja template.*line 1"):
        read_chat_template("{% if add_generation_prompt %}unclosed")


@pytest.mark.slow  # an engine load; the fast tier reads and refuses templates (test above)
def test_a_chat_template_given_to_the_engine_replaces_the_models(tmp_path):
    from goodserve import LLM, SamplingParams

    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    llm = LLM(max_model_len=256, quantization="none", chat_template=str(path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = "[system] Be brief.\n[user] Name a colour.\n[assistant] "  # by hand
    assert llm.tokenizer.apply_chat_template(messages) == prompt
    params = SamplingParams(temperature=0, max_tokens=4)
    expected = llm.generate({"prompt_token_ids": llm.tokenizer.encode(prompt, add_special_tokens=False)}, params)
    assert llm.chat(messages, params)[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 3}]])
def test_bad_messages_are_invalid_request(tok: Tokenizer, messages):
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def test_template_raise_exception_becomes_invalid_request(tok: Tokenizer):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    strict = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], chat_template=template)
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sees_bos_and_eos_tokens():
    backend = HFTokenizer(models.BPE(vocab={"a": 0, "<s>": 1, "</s>": 2}, merges=[]))
    tokenizer = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template="{{ bos_token }}|{{ eos_token }}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": ""}]) == "<s>|</s>"


def test_no_chat_template_is_invalid_request(tok: Tokenizer):
    bare = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], chat_template=None)
    with pytest.raises(InvalidRequestError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


STREAM_TEXT = "Emoji 🤖🚀👩‍👩‍👧‍👦 then 日本語のテキスト and 한국어 — done. ñ é 🇫🇷"


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
    deltas = [detok.add_tokens([i]) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_stream_never_emits_partial_characters(tok: Tokenizer):
    ids = tok.encode(STREAM_TEXT)
    # The test only means something if some tokens really are partial characters on their own.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == STREAM_TEXT


def test_stream_after_prompt_and_with_special_tokens(tok: Tokenizer):
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("Sure 👍🏽 — 日本<|im_end|>")
    for skip in (True, False):
        deltas = stream(tok, ids, prompt=prompt, skip=skip)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tok, ids, prompt=prompt, skip=False)).endswith("<|im_end|>")


def test_stream_cut_mid_character_flushes_the_rest(tok: Tokenizer):
    ids = tok.encode("ok 🤖")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    deltas = stream(tok, ids[:cut])
    assert not any("\ufffd" in d for d in deltas[:-1])  # held back until the final flush
    assert "".join(deltas) == tok.decode(ids[:cut])


def write_sentencepiece_gguf(path) -> None:
    """A tiny Llama-2-style vocabulary: control tokens, byte fallbacks, "\u2581" pieces, scores."""
    import gguf

    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "\u2581he", "llo", "\u2581hello",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u2581\u2581"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(i) for i in range(len(pieces)))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize("text", ["hello world", "  hello\u00e9 wor ld!", "hello</s>", "\u65e5"])
def test_sentencepiece_gguf_tokenizer_matches_hf(tmp_path, text: str):
    from goodserve.model.gguf_reader import open_gguf
    from goodserve.model.gguf_tokenizer import gguf_tokenizer

    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path)
    ours = gguf_tokenizer(open_gguf(path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ids[0] == 1  # BOS, as llama.cpp adds for a SentencePiece vocabulary
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_stream_after_a_prompt_cut_mid_character_emits_the_character_whole(tok: Tokenizer):
    ids = tok.encode("ok 🤖 yes")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    deltas = stream(tok, ids[cut:], prompt=ids[:cut])
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas).endswith("🤖 yes")
    assert "ok" not in "".join(deltas)  # nothing of the prompt's whole characters comes back


def test_stream_goes_on_where_the_decoder_rewrites_earlier_text():
    # "ab" decodes to "XYZ", which does not extend "a"'s text: DecodeStream refuses that window.
    backend = HFTokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2}, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_ids=[])
    deltas = stream(tokenizer, [0, 1, 2, 2])
    assert deltas[0] == "a" and deltas[2:4] == ["c", "c"]
