"""What an algorithm implements and what it may use: ``algorithm`` is the contract (Server,
Edge, Client, Reporter, Algorithm, their contexts and hyperparameters), ``kit`` the pieces
methods share (local training requests, proximal pulls, averaging, reply checks). The
methods themselves are in ``edgepfl.algorithms``; nothing here imports a runtime."""
