"""A request's next output: its token appended, its text, stop conditions, what may stream.

The text of the byte tokenizer is built incrementally (each token's byte through one UTF-8
incremental decoder), the same text as decoding every output token again, at a cost per token
instead of per output so far (decoding 512 tokens again took ~25-230 us a request a step on
the CI machine). Other tokenizers decode the whole output each time, as before: a window over
the last tokens (vLLM's incremental detokenizer) is not exactly the full decode for every
tokenizer.json. A stop string is searched only where it can first appear: text whose prefix
is unchanged held no stop string at the last token.
"""

from __future__ import annotations

import codecs

from engine.model.tokenizer import Tokenizer
from engine.request import Request, StepOutput


class OutputText:
    """The output text of one request as its tokens arrive."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes = tokenizer.kind == "bytes"
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._done = ""
        """Text of the bytes decoded for good (an incomplete character's bytes are pending)."""

    def append(self, token: int, token_ids: list[int]) -> tuple[str, int]:
        """The text of ``token_ids`` (the output so far, ``token`` last) and how many of its
        leading characters are the same as in the text returned last time."""
        if not self._bytes:
            return self.tokenizer.decode(token_ids), 0
        same = len(self._done)
        if 0 <= token < 256:  # higher ids are specials with no text
            self._done += self._decoder.decode(bytes((token,)))
        pending = self._decoder.getstate()[0]
        # An incomplete character reads as U+FFFD, as a decode of all the bytes ends.
        tail = pending.decode("utf-8", errors="replace") if pending else ""
        return self._done + tail, same


def next_output(req: Request, token: int, tokenizer: Tokenizer, max_model_len: int) -> StepOutput:
    """Append ``token`` to ``req`` and make its output; ``finish_reason`` set when it stops
    (the caller finishes the request)."""
    req.output_token_ids.append(token)
    if req.text is None:
        req.text = OutputText(tokenizer)
    text, same = req.text.append(token, req.output_token_ids)
    reason = None
    if token in req.eos_token_ids:
        reason = "eos"
    elif token in req.params.stop_token_ids:
        reason = "stop"
    for stop in req.params.stop:
        cut = text.find(stop, max(0, same - len(stop) + 1))
        if cut >= 0:
            text, reason = text[:cut], "stop"
            break
    if reason is None and (len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len):
        reason = "length"
    req.output_text = text
    return StepOutput(
        request_id=req.request_id, new_token_ids=[token],
        new_text=stream_text(req, text, finished=reason is not None),
        finished=reason is not None, finish_reason=reason,
        num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=max(req.num_cached_tokens, 0),
        num_external_cached_tokens=req.num_external_cached_tokens,
    )


def stream_text(req: Request, text: str, finished: bool) -> str:
    """Text safe to stream now: hold back a tail that may still become a stop string or
    an incomplete UTF-8 character (decoded as U+FFFD until its last byte arrives)."""
    hold = 0
    if not finished:
        # Before an incomplete character too: it may complete a stop string begun before it.
        done = text.rstrip("\ufffd")
        pending = hold = len(text) - len(done)
        for stop in req.params.stop:
            for k in range(len(stop) - 1, 0, -1):
                if done.endswith(stop[:k]):
                    hold = max(hold, pending + k)
                    break
    end = max(len(text) - hold, req.num_text_streamed)
    out = text[req.num_text_streamed : end]
    req.num_text_streamed = end
    return out
