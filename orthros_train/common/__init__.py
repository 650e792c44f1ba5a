"""The floor under every layer: one way to write, lock, hash and read files.

Each layer of the project (``model``, ``data``, ``train``, ...) may import only the layers below it,
so before this package every layer that needed an atomic write, a lock or a safetensors reader
wrote its own. They live here once:

- ``files``: atomic writes with one durability rule, sha256 of a file, the umask rule for files
  libraries create with fixed modes.
- ``lock``: the heartbeat lock that guards run directories and data caches (correct on NFS,
  Lustre and GPFS as well as on a local disk).
- ``safetensors_io``: a lazy reader of a folder of safetensors shards and a streaming sharded
  writer with its index.
- ``tokenizer``: the one tokenizer loader.
- ``overrides``: the one checker of ``key=value`` overrides against typed dataclasses.

Nothing here imports a project layer; every layer may import it.
"""
