"""LayerNormalization, GroupNormalization, BatchNormalization (inference only).

Their weights are small (scale and offset per channel), so the exact
layer-local VJP costs little. BatchNormalization in training mode couples the
examples of a batch and is refused before any engine runs.
"""

import keras

from per_example_grads.layers.local import LOCAL_RULE
from per_example_grads.layerwise.rule import register_layer_rule

for _cls in (keras.layers.LayerNormalization, keras.layers.GroupNormalization, keras.layers.BatchNormalization):
    register_layer_rule(_cls, LOCAL_RULE)
