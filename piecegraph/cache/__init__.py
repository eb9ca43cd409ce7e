"""The artifact cache: what one start compiled, kept so that the next process with the same model and config
starts warm (``Config(cache_dir=...)``, ``PIECEGRAPH_CACHE_DIR``, ``piecegraph cache info | clear``).

Layout under the cache folder::

    entries/<key>/mega.bin        torch.compiler.save_cache_artifacts() of the cold start (torch >= 2.7)
    entries/<key>/trace.pkl       the traced program (build.TraceSnapshot): a warm start skips Dynamo
    entries/<key>/manifest.json   the key's material, each file's size and sha256; written last
    entries/<key>/unitN.pt2       AOTInductor packages of the compiled units, and packaged.pkl, the program
                                  built from them (Config.aot_package): a warm start imports no compiler
    locks/<key>.lock              one start per key at a time (filelock, else fcntl)
    packaging/<key>.json|.log     a background packaging worker's state and output (trace/aot_worker.py);
              <key>.job|.lock     its work, and the lock it holds while it runs
    inductor/                     TORCHINDUCTOR_CACHE_DIR during setup: Inductor's FX graph and AOTAutograd
                                  caches and compiled kernels (content-addressed by Inductor itself)
    flashinfer/                   FLASHINFER_WORKSPACE_BASE, when FlashInfer was not imported yet

What each torch version gets: every torch piecegraph supports keeps Inductor's FX graph cache (and, from 2.6,
AOTAutograd's) in ``inductor/``; torch >= 2.7 also gets the mega-cache blob, which refills those caches even
when ``inductor/`` was cleared or the entry copied to another machine of the same GPU and versions. Dynamo's
own precompile does not serialize a custom backend's split program, so piecegraph keeps the traced graph itself
(``trace.pkl``, every torch): a warm start restores it and builds the program without Dynamo, and saves
Inductor's code generation and kernel builds too.

Safety: an entry is used only when its manifest exists (written last, by atomic rename), its material equals
this start's (a stale entry, e.g. another torch, is rebuilt) and every file's checksum matches (a corrupt or
truncated one is rebuilt); a start holds its key's lock from lookup to publish, so a second process starting at
once waits, then starts warm.
"""

from .key import cache_key, key_material
from .packaging import wait_packaging
from .paths import resolve_cache_dir
from .session import compile_cache
from .store import Store

__all__ = ["Store", "cache_key", "compile_cache", "key_material", "resolve_cache_dir", "wait_packaging"]
