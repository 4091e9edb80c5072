"""What keeps the cache and checkpoints honest: manifests, content keys, build locks, temporaries.

A layer beside ``paths`` and ``fileio`` (they use it; it uses nothing of Quasar's but
``errors`` and ``paths``): ``manifest`` (each file's size and hash, checked on load),
``keys`` (cache keys from a source's content, not its path), ``locking`` (one build of an
entry at a time), ``temps`` (temporaries a later run can find and remove), ``entries``
(looking an entry up: verified, or dropped for a rebuild) and ``commands`` (``quasar cache``).
"""
