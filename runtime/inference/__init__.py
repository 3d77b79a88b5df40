"""The inference protocol: data-plane messages, the hop server, chains, dispatch, chat."""
