"""The router hashes what the engine computes: for a model with a real ``tokenizer.json`` and a
chat template, the router renders (events.prompt) and encodes (events.tokenizer, which the engine
loads too) the prompt the engine will see, and its block hashes are the ones the engine's prefix
cache uses; with no model directory both encode bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.model.tokenizer import load_tokenizer
from events.hashing import BlockHasher, to_wire
from events.prompt import ChatMessage, load_chat_template
from events.tokenizer import TokenizerError
from router.config import EngineSpec, RouterConfig
from router.main import main as router_main
from router.service import Router

WORDS = ["<unk>", "<|user|>", "<|assistant|>", "hello", "there", "router", "cache", "prefix", "!", "?"]


def _model_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
    return tmp_path


def test_router_and_engine_encode_alike(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    text = load_chat_template(model).render([ChatMessage("user", "hello router cache prefix ! " * 6)])
    engine_ids = load_tokenizer(model).encode(text)
    assert engine_ids[0] == WORDS.index("<|user|>") and WORDS.index("<unk>") not in engine_ids
    router = Router(RouterConfig(engines=(EngineSpec("e", "http://h:1"),), model_dir=str(model), block_size=4),
                    None, None)  # type: ignore[arg-type]  # no forwarding here
    assert router.tokenizer.kind == "tokenizer.json"
    assert router.encode(text) == engine_ids
    hashes = router.hashes(engine_ids)
    n = (len(engine_ids) - 1) // 4
    assert hashes == [to_wire(d) for d in BlockHasher(router.config.hash_seed, 4).hash_blocks(engine_ids[: n * 4])]
    assert len(hashes) == n > 0


def test_no_model_dir_encodes_bytes_on_both_sides(tmp_path: Path) -> None:
    router = Router(RouterConfig(engines=(EngineSpec("e", "http://h:1"),), block_size=4),
                    None, None)  # type: ignore[arg-type]  # no forwarding here
    assert router.tokenizer.kind == "bytes" == load_tokenizer(tmp_path).kind
    assert router.encode("hé") == load_tokenizer(tmp_path).encode("hé") == [104, 195, 169]


def test_a_broken_tokenizer_json_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a tokenizer"):
        load_tokenizer(tmp_path)
    rc = router_main(["--engine", "http://127.0.0.1:1", "--model", str(tmp_path), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "kv-router: error:" in err and "tokenizer.json" in err and "Traceback" not in err
