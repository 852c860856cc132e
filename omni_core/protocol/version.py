"""Wire protocol version.

Bumped on any change a peer of the previous version could misread. Peers refuse every other
version with a message naming both, instead of guessing at a schema they do not know.
"""

PROTOCOL_VERSION: int = 1
