"""Images in prompts: where an image may come from (media), the vision-language families run,
prompts and chat messages with images as token ids and spans (inputs), the vision tower's embeddings."""
from engine.multimodal.families import FAMILIES, Family, family_of
from engine.multimodal.inputs import (DEFAULT_LIMIT, ImageInputs, ImageSpan, image_parts, media_policy,
                                      placeholder_runs)
from engine.multimodal.media import MediaPolicy, load_image
from engine.multimodal.vision import VisionFeatures, vision_features

__all__ = ["FAMILIES", "Family", "family_of", "DEFAULT_LIMIT", "ImageInputs", "ImageSpan", "image_parts", "media_policy",
           "placeholder_runs", "MediaPolicy", "load_image", "VisionFeatures", "vision_features"]
