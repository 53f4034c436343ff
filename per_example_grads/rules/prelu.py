"""PReLU: ``alpha`` has the input's feature shape; the layer-local VJP is exact and cheap."""

import keras

from per_example_grads.rules.local import LOCAL_RULE
from per_example_grads.rules.rule import register_layer_rule

register_layer_rule(keras.layers.PReLU, LOCAL_RULE)
