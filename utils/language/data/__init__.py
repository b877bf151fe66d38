"""The language wing's sources: the text source interface (text.py), WikiText and Hugging Face parquet
(wikitext.py), token shards (tokens.py, shards.py, prepare.py), tokenizers, packed documents."""
