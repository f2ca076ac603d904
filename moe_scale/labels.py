"""The target id no loss counts (padding, <S>, a token outside the evaluated words): F.cross_entropy's
ignore_index. Data marks targets with it; every output layer gives such a target a loss of 0."""

IGNORE = -100
