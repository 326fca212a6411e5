"""`from pipeline.index import part_entries`, as the README documents: the part index lives in
pipeline.io.index."""
from pipeline.io.index import ENTRIES_PER_FILE, INDEX_DIR, LAYOUT, IndexWriter, entries, part_entries  # noqa: F401

__all__ = ["part_entries", "entries", "IndexWriter", "ENTRIES_PER_FILE", "INDEX_DIR", "LAYOUT"]
