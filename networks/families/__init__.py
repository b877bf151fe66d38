"""The built-in model families, one folder each (vit/, gpt/, llama/): found by a scan of this package
(utils/tasks/registry.py), not listed anywhere. A folder's `__init__.py` follows the family contract
(`FAMILY = networks.spec.ModelSpec(...)`, optional `PRESETS`) and holds, or imports from the folder, all that the
family brings: its model and schema, its layout rules, its Hugging Face adapter. A family outside the tree follows
the same contract and is found through an entry point or DLSCALE_FAMILIES (docs/architecture.md).

GPT-2 and Llama are two configurations of one decoder (networks/transformer.py, its schema and its layout rules;
networks/decoder_exchange.py, the part of their Hugging Face exchange they share): their folders own the rest.
"""
