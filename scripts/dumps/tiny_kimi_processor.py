"""The reduced Kimi-K2.5's processor: code that ships inside the checkpoint, as Kimi-K2.5's
own processor does, loaded by transformers with trust_remote_code.

scripts.dumps.tiny_model.ensure_kimi_model copies this file into the model folder. SGLang
0.5.14 and later build their Kimi-K2.5 multimodal processor from it: they read its
tokenizer, its image_processor and its media_processor's media_proc_cfg (patch and merge
sizes, limits, normalization). The tests send token ids only, so it processes no media.
Only transformers may be imported here: the dynamic module loader checks the imports.
"""

from transformers import ProcessorMixin


class KimiK25MediaProcessor:
    """Holds media_proc_cfg, the settings Kimi-K2.5's preprocessor_config.json carries."""

    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = media_proc_cfg


class KimiK25Processor(ProcessorMixin):
    attributes = ["tokenizer"]
    tokenizer_class = "AutoTokenizer"

    def __init__(self, tokenizer=None, media_proc_cfg=None, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.media_processor = self.image_processor = KimiK25MediaProcessor(media_proc_cfg)
