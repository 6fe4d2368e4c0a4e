"""A small synthetic GGUF for staging and driver tests (written with gguf.GGUFWriter)."""
import numpy as np


def write_synthetic_gguf(path, *, n_layers=3, width=64, seed=0, big=0):
    """`n_layers` blocks of F32 tensors plus token_embd/output_norm/output.  `big` adds that
    many extra float32 elements to each layer's ffn tensor, to make the file larger."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_name("ntx-synthetic")
    w.add_tensor("token_embd.weight", rng.standard_normal((32, width), dtype=np.float32))
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(width, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     rng.standard_normal((width, width), dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight",
                     rng.standard_normal(width * 3 + big, dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(width, dtype=np.float32))
    w.add_tensor("output.weight", rng.standard_normal((32, width), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
