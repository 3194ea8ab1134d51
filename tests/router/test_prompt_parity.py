"""The router hashes what the engine computes: for a model with a real ``tokenizer.json`` and a
chat template, events.prompt (the router's side) renders and encodes exactly as the engine's
HTTP API and tokenizer do, and its block hashes are the ones the engine's prefix cache uses."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from engine.model.tokenizer import load_tokenizer
from events.hashing import BlockHasher, to_wire
from events.prompt import ChatMessage, PromptTokenizer, load_chat_template
from router.config import EngineSpec, RouterConfig
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
    router_tok = PromptTokenizer(model)
    assert router_tok.kind == "tokenizer.json"
    assert router_tok.encode(text) == engine_ids and engine_ids[0] == WORDS.index("<|user|>")
    assert WORDS.index("<unk>") not in engine_ids
    router = Router(RouterConfig(engines=(EngineSpec("e", "http://h:1"),), model_dir=str(model), block_size=4),
                    None, None)  # type: ignore[arg-type]  # no forwarding here
    hashes = router.hashes(engine_ids)
    n = (len(engine_ids) - 1) // 4
    assert hashes == [to_wire(d) for d in BlockHasher(router.config.hash_seed, 4).hash_blocks(engine_ids[: n * 4])]
    assert len(hashes) == n > 0
