"""Export a torchtitan llama3 debug-model checkpoint as a Hugging Face folder
(``stepvault.integrations.torchtitan.export_hf``), for tests/test_torchtitan.py. Run in the
torchtitan environment::

    python tests/scripts/torchtitan_export_hf.py ROOT RUN STEP OUT FULL EXPECTED

``FULL``: the job's full weights (torchtitan names, safetensors); ``EXPECTED`` receives
them mapped by torchtitan's own adapter (``to_hf``): what the exported folder must hold.
The Hugging Face config is made from torchtitan's model config.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    root, run, step, out, full, expected = sys.argv[1:7]
    sys.path.insert(0, str(HERE))
    from torchtitan_train import _stub_triton_kernels

    _stub_triton_kernels()  # TEST-ONLY: the CPU torch has no Triton (torchtitan_train.py)
    from safetensors.torch import load_file, save_file
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from stepvault.integrations.torchtitan import export_hf

    model = model_registry("debugmodel").model
    attn = model.layers[0].attention
    w1 = model.layers[0].feed_forward.w1
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.dim,
        "intermediate_size": w1.out_features,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads or attn.n_heads,
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": bool(model.enable_weight_tying),
        "rms_norm_eps": model.norm.eps,
        "torch_dtype": "float32",
    }
    adapter = Llama3StateDictAdapter(model, None)
    export_hf(root, run, out, adapter=adapter, config=config, step=int(step))
    weights = load_file(full)
    save_file({k: v.contiguous() for k, v in adapter.to_hf(weights).items()}, expected)


if __name__ == "__main__":
    main()
