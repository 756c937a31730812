"""Token ids and the loss mask of a conversation, from the target model's tokenizer and chat
template.

The loss mask marks exactly the tokens the assistant wrote (its replies and the end of each
reply the template adds). Two ways to find them:

- the template marks replies with `{% generation %}`: transformers' assistant mask
  (apply_chat_template with return_assistant_tokens_mask);
- it does not (DeepSeek-V3's, Kimi's): render the conversation up to each assistant turn
  with the generation prompt, then up to the end of that turn; each rendering must extend
  the one before and the whole conversation must extend them all, so the reply is the
  text between the two. Tokens of the whole rendering whose text starts inside a reply
  are the assistant's.

A template that allows neither (it rewrites earlier turns, as templates that drop past
reasoning do) is refused at startup; `--loss-mask all` trains on every token instead.

Turns go to the template as SGLang's chat endpoint gives them: tool-call arguments given as
JSON text as objects, the record's tool definitions as `tools`. SGLang also fills each turn's
unset fields with nulls (its message models): a template that tests whether a key is present,
rather than whether it is set, can render the same turn differently there.

Plain text records (a base model's data) are the text's tokens as the tokenizer encodes it,
with its own special tokens, all in the loss. A tokenizer without a chat template (a base
model's) takes only those: a conversation is then rejected, naming --chat-template.
"""

import copy
import re
from pathlib import Path
from typing import List, Optional, Tuple

from scripts.dumps.conversations import Rejected, tool_call_arguments
from scripts.toolchain.errors import USAGE, ToolError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
LOSS_MASKS = ("assistant", "all")
# A conversation every template renders; used to test the prefix property at startup.
PROBE = [
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a fact."},
    {"role": "assistant", "content": "Honey never spoils."},
]


def load_tokenizer(model: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError) as e:
        raise ToolError(f"cannot load the tokenizer of {model}: {e}", USAGE)


class ChatEncoder:
    """Encodes conversations with one tokenizer, one template and one loss-mask rule."""

    def __init__(self, tokenizer, template: Optional[str] = None, loss_mask: str = "assistant"):
        self.tokenizer = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None)
        if loss_mask not in LOSS_MASKS:
            raise ToolError(f"--loss-mask is one of {', '.join(LOSS_MASKS)}, not {loss_mask!r}", USAGE)
        if not getattr(tokenizer, "is_fast", False):
            raise ToolError("the tokenizer is not a fast (Rust) tokenizer: its token offsets, which the "
                            "loss mask needs, are not available", USAGE)
        self.loss_mask = loss_mask
        self.generation_markers = bool(self.template and GENERATION_MARKER.search(self.template))
        if self.template and loss_mask == "assistant" and not self.generation_markers:
            try:
                self._reply_spans(PROBE, self._render(PROBE))
            except Rejected as e:
                raise ToolError(
                    f"this chat template has no {{% generation %}} markers and the assistant's tokens cannot be "
                    f"found by rendering turn by turn ({e.reason}). Pass --chat-template with a template that "
                    f"marks replies with {{% generation %}}, or --loss-mask all to train on every token.", USAGE)

    @property
    def method(self) -> str:
        if not self.template:
            return "no chat template: plain text records only, every token"
        if self.loss_mask == "all":
            return "every token (--loss-mask all)"
        return "generation markers" if self.generation_markers else "turn-by-turn prefixes"

    def encode(self, messages: List[dict], tools: Optional[List[dict]] = None) -> Tuple[List[int], List[int]]:
        """(token ids, loss mask) of a whole conversation (with its tool definitions); raises
        Rejected when the template refuses it or renders it inconsistently."""
        if not self.template:
            raise Rejected("template", "a conversation, and the tokenizer has no chat template: pass "
                                       "--chat-template FILE, or give plain text records ({\"text\": ...})")
        if self.loss_mask == "assistant" and self.generation_markers:
            try:
                encoded = self.tokenizer.apply_chat_template(
                    template_messages(messages), chat_template=self.template, tools=tools, tokenize=True,
                    return_dict=True, return_assistant_tokens_mask=True)
            except Exception as e:  # jinja2's errors and the template's own raise_exception
                raise Rejected("template", f"the chat template refused it: {e}")
            ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
            if 1 not in mask:
                raise Rejected("template", "the chat template marks no token of it as the assistant's")
            return ids, mask
        text = self._render(messages, tools)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        if self.loss_mask == "all":
            return ids, [1] * len(ids)
        spans = self._reply_spans(messages, text, tools)
        mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
        return ids, mask

    def generation_prompt(self, messages: List[dict], tools: Optional[List[dict]] = None) -> List[int]:
        """The token ids that ask the model for the next assistant turn after `messages`:
        the template's rendering with its generation prompt, tokenized as `encode` does."""
        if not self.template:
            raise Rejected("template", "a conversation, and the tokenizer has no chat template: pass --chat-template FILE")
        text = self._render(messages, tools, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        """An answer's text, as a chat client shows it: its special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_text(self, text: str) -> Tuple[List[int], List[int]]:
        """(token ids, loss mask) of a plain text record: every token in the loss."""
        ids = list(self.tokenizer(text)["input_ids"])
        return ids, [1] * len(ids)

    def _render(self, messages: List[dict], tools: Optional[List[dict]] = None,
                add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(template_messages(messages), chat_template=self.template,
                                                      tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise Rejected("template", f"the chat template refused it: {e}")

    def _reply_spans(self, messages: List[dict], text: str, tools: Optional[List[dict]] = None) -> List[Tuple[int, int]]:
        """Character spans of the assistant's replies in the rendering `text`."""
        spans = []
        for n, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:n], tools, add_generation_prompt=True)
            through = self._render(messages[:n + 1], tools)
            if not through.startswith(before):
                raise Rejected("template", f"rendering turn {n} changes the text before it")
            if not text.startswith(through):
                raise Rejected("template", f"the turns after turn {n} change how it renders")
            if len(through) == len(before):
                raise Rejected("template", f"turn {n} (the assistant's) renders as nothing")
            spans.append((len(before), len(through)))
        return spans


def template_messages(messages: List[dict]) -> List[dict]:
    """The turns as SGLang's chat endpoint hands them to the template: tool-call arguments
    given as JSON text parsed into objects (templates render objects), the rest as given."""
    if not any("tool_calls" in message for message in messages):
        return messages
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = tool_call_arguments(call["function"].get("arguments"))
    return messages
