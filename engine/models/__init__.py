"""Models and tokenizers from the outside world: builtin models, Hugging Face Hub snapshots, local and
object-storage directories and the checks on their files, and the tokenizer the engine speaks through."""
from engine.models.builtin import (builtin_path, byte_tokenizer, default_cache_dir, is_builtin, quiet_transformers,
                                   real_model_file)
from engine.models.files import (check_model_files, check_weights, copy_remote, is_hub_model, load_tokenizer, read_config,
                                 resolve_model_dir)
from engine.models.gguf import converted_from as gguf_source
from engine.models.identity import model_identity
from engine.models.pooling import PoolingInfo, model_pooling_info, read_pooling_info
from engine.models.tokenizer import StopStringChecker, Tokenizer, find_stop

__all__ = ["is_builtin", "builtin_path", "byte_tokenizer", "default_cache_dir", "quiet_transformers",
           "resolve_model_dir", "is_hub_model", "check_model_files", "check_weights", "copy_remote", "load_tokenizer",
           "read_config", "Tokenizer", "StopStringChecker", "find_stop", "PoolingInfo", "model_pooling_info",
           "read_pooling_info", "gguf_source", "real_model_file", "model_identity"]
