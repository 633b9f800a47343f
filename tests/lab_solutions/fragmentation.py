"""A correct solution of lab `fragmentation`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs fragmentation tests/lab_solutions/fragmentation.py``.
"""


def student_internal_fragmentation(num_tokens, block_size):
    return sum((block_size - n % block_size) % block_size for n in num_tokens)
