"""Local training, below every algorithm: a client's data as an index view
(``client_data``), the trainer that loads, fits and exports one module skeleton
(``trainer``, with ``sgd``, ``pulls``, ``device``, ``evaluation``, ``features``) and
several clients' fits at once (``batched``)."""
