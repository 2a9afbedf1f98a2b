"""The decoder's old module name: ``shardlm.model.llama`` *is* :mod:`shardlm.model.decoder` (one module
object, so ``Llama``, ``KVCache``, ``rope_inv_freq``... and patches of its functions are the decoder's own),
kept importable while code and tests move to the new names."""

import sys

from shardlm.model import decoder

sys.modules[__name__] = decoder
