"""Tokenizer files, the sandboxed chat template, and stop ids."""

import json

import pytest

from hybrid.checkpoint_files import CheckpointError
from hybrid.tokenizer import Tokenizer
from tiny_checkpoint import write_tokenizer


@pytest.fixture
def tokdir(tmp_path):
    write_tokenizer(tmp_path)
    return tmp_path


def test_round_trip_text(tokdir):
    tok = Tokenizer.from_dir(tokdir)
    text = "The pass key is 12345. naïve café 東京 ✓"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(tokdir):
    tok = Tokenizer.from_dir(tokdir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<|im_end|>") in ids


def test_template_file_and_kwargs(tokdir):
    (tokdir / "chat_template.jinja").write_text(
        "{{ bos_token }}{% if enable_thinking %}<think>{% else %}none{% endif %}{{ messages[0]['content'] | tojson }}")
    tok = Tokenizer.from_dir(tokdir)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}], enable_thinking=True) == '<s><think>"é"'


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__ }}",
    "{% set _ = messages.append(1) %}",
])
def test_template_runs_sandboxed(tokdir, template):
    (tokdir / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_dir(tokdir)
    with pytest.raises(ValueError, match="is unsafe"):  # jinja2's SecurityError, reported as a template failure
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_in_template(tokdir):
    (tokdir / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_dir(tokdir).apply_chat_template([])


def test_stop_ids_union(tokdir):
    (tokdir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = Tokenizer.from_dir(tokdir, config_eos=[1])
    assert tok.stop_ids == [1, 2, 3, 4]


def test_missing_tokenizer(tmp_path):
    from hybrid.checkpoint_files import CheckpointError

    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_tokens_from_lists_the_entries_past_an_id(tokdir):
    tok = Tokenizer.from_dir(tokdir)
    assert tok.tokens_from(318) == {318: tok._tok.id_to_token(318), 319: tok._tok.id_to_token(319)}
    assert tok.tokens_from(320) == {} and list(tok.tokens_from(0))[:5] == [0, 1, 2, 3, 4]
    assert tok.tokens_from(0)[4] == "<|im_end|>"


@pytest.mark.parametrize("template, message", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),  # before: a ZeroDivisionError traceback
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses too deeply (RecursionError)"),
    ('{{ "%d"|format("x") }}', "TypeError: %d format: a real number is required, not str"),
    ("{{ range(10**9)|list }}", "Range too big"),  # before: OverflowError from the sandbox
    ("{{ range(200000)|list|length }}", "MAX_RANGE (100000)"),  # jinja2's own limit is 100,000,000
    ("{{ 'ab' * 100000000 }}", "exceeds the limit of 16,777,216"),  # before: tokenizers panicked (exit 134)
    ("{{ [1] * 100000000 }}", "exceeds the limit of 16,777,216"),
    ("{{ 10 ** 100000000 }}", "is too large"),
    ("{% for i in range(3000) %}{{ 'x' * 10000 }}{% endfor %}", "rendered 30,000,000 characters, more than the limit"),
    ("{% if false %}x{% endif %}", "rendered an empty string"),  # before: "prompts must be a non-empty list ..."
    ("{% for %}", "chat template failed: "),  # a syntax error
])
def test_template_failures_name_the_file_and_the_exception(tokdir, template, message):
    (tokdir / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_dir(tokdir)
    with pytest.raises(ValueError) as info:
        tok.encode_chat([{"role": "user", "content": "x"}])
    assert str(info.value).startswith(f"{tokdir / 'chat_template.jinja'}: chat template ")
    assert message in str(info.value)


def test_template_from_tokenizer_config_is_named(tokdir):
    config = json.loads((tokdir / "tokenizer_config.json").read_text())
    (tokdir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 1/0 }}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(`chat_template`\): chat template failed: "
                                         "ZeroDivisionError"):
        Tokenizer.from_dir(tokdir).apply_chat_template([])


def test_generate_chat_with_a_failing_template_is_one_clear_error(tmp_path, capsys):
    from hybrid.cli import main
    from tiny_checkpoint import write_checkpoint

    d = write_checkpoint(tmp_path, "M*E-", seed=1)
    (d / "chat_template.jinja").write_text("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    rc = main(["generate", str(d), "--prompt", "hi", "--chat", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert f"{d / 'chat_template.jinja'}: chat template failed: it recurses too deeply" in err


def test_sampling_defaults_from_generation_config(tokdir):
    """generation_config.json's temperature / top_p / top_k where present; `do_sample: false` means greedy."""
    assert Tokenizer.from_dir(tokdir).sampling_defaults == {}
    path = tokdir / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    assert Tokenizer.from_dir(tokdir).sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "top_p": 0.95}))
    assert Tokenizer.from_dir(tokdir).sampling_defaults == {"temperature": 0.0, "top_p": 0.95}


@pytest.mark.parametrize("field, value", [("temperature", -1), ("temperature", "0.7"), ("temperature", True),
                                          ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
                                          ("do_sample", "no")])
def test_sampling_defaults_out_of_range_name_the_file(tokdir, field, value):
    (tokdir / "generation_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(CheckpointError, match=rf"generation_config.json: `{field}` must be"):
        Tokenizer.from_dir(tokdir)
