"""ulysses-mm: one transformer on million-token streams of video, audio and DNA."""

__version__ = "0.1.0"
