"""Qwen2.5-VL's processor without its video part, for the tiny Qwen-Image-Edit-Plus pipeline.

transformers builds the video processor only with torchvision, which the base install lacks (the real checkpoint
loads transformers' own `Qwen2VLProcessor` under the cuda and tpu extras, which bring it). Images are processed
exactly as there: same tokens, same image processor (its PIL backend).
"""

from __future__ import annotations

from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageOnlyQwenVLProcessor(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
