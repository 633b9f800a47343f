"""A correct solution of lab `kv_block_bytes`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs kv_block_bytes tests/lab_solutions/kv_block_bytes.py``.
"""


def student_kv_block_bytes(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes):
    per_token_per_layer = num_kv_heads * head_dim * dtype_bytes * 2     # a key and a value
    return per_token_per_layer * num_layers * block_size
