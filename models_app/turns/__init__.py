"""Turns: the turn service, the Responses turn and its chain, embeddings, stored transcripts."""
