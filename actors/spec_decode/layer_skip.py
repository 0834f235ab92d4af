"""A layer-skip self-draft: the first N decoder layers of a model, with its embeddings,
final norm and LM head, saved as a Hugging Face directory that `draft_model` loads. It
shares the target's tokenizer by construction and costs about N / num_hidden_layers of a
target step, with no separate training; its drafts agree with the target less the fewer
layers it keeps (the benchmark's draft for the embedded model, which has no smaller
sibling, and a draft that agrees often for the tests).

    python -m actors.spec_decode.layer_skip MODEL OUT_DIR --num-layers N"""

from __future__ import annotations

import argparse
import json
import os
import shutil


def save_layer_skip_draft(model: str | None, out_dir: str, num_layers: int) -> str:
    """out_dir, holding model's first num_layers layers (model: a Hugging Face directory, a
    .gguf file or None for the embedded default) as a Hugging Face directory."""
    from safetensors.torch import save_file

    from actors.models.loader import iter_weights, resolve_model

    model_dir = resolve_model(model)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    os.makedirs(out_dir, exist_ok=True)
    kept = {}
    for name, tensor in iter_weights(model_dir):
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
            continue
        kept[name] = tensor.contiguous()
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(model_dir):  # the tokenizer and generation config, as they are
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template", "vocab", "merges")):
            shutil.copy(os.path.join(model_dir, name), os.path.join(out_dir, name))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face directory or a .gguf file ('default': the embedded model)")
    parser.add_argument("out_dir")
    parser.add_argument("--num-layers", type=int, required=True)
    args = parser.parse_args()
    print(save_layer_skip_draft(args.model, args.out_dir, args.num_layers))


if __name__ == "__main__":
    main()
