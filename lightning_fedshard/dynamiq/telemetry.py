"""What the compressed collectives report: bytes on the wire, bits per coordinate and (debug) error."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompressionStats"]


@dataclass
class CompressionStats:
    """Running totals of one rank's compressed collectives.

    ``bits_per_coord`` is wire bits ÷ the coordinates an exact ring would send for the same tensors,
    so it is directly comparable with 32 (fp32) or 16 (bf16). ``vnmse`` is filled only when the
    caller asks for the exact reference (debug mode), which costs one extra all-reduce per call.

    Example::

        stats = CompressionStats()
        all_reduce(grad, codec="dynamiq", bits=5.0, stats=stats, debug=True)
        print(stats.bits_per_coord, stats.vnmse)
        module.log_dict(stats.take_metrics("dynamiq/gradients"))  # once per step
    """

    calls: int = 0
    compressed_calls: int = 0
    #: compressed calls whose input was copied into padded, block-sized chunks (not a view of it)
    rechunked_calls: int = 0
    numel: int = 0
    wire_bytes: float = 0.0
    reference_coords: float = 0.0
    squared_error: float = 0.0
    squared_norm: float = 0.0

    @property
    def bits_per_coord(self) -> float:
        return 8 * self.wire_bytes / self.reference_coords if self.reference_coords else 0.0

    @property
    def vnmse(self) -> float | None:
        """‖Ŝ − S‖² / ‖S‖² summed over the calls made in debug mode; ``None`` when none was."""
        return self.squared_error / self.squared_norm if self.squared_norm else None

    def record(self, numel: int, wire_bytes: float, reference_coords: float, compressed: bool) -> None:
        self.calls += 1
        self.compressed_calls += int(compressed)
        self.numel += numel
        self.wire_bytes += wire_bytes
        self.reference_coords += reference_coords

    def record_error(self, squared_error: float, squared_norm: float) -> None:
        self.squared_error += squared_error
        self.squared_norm += squared_norm

    def take_metrics(self, prefix: str) -> dict[str, float]:
        """The totals since the last call as ``{prefix}/wire_bytes``, ``{prefix}/bits_per_coord`` (and
        ``{prefix}/vnmse``), then starts over; empty when no collective ran, so steps without one log nothing."""
        if not self.calls:
            return {}
        metrics = {f"{prefix}/wire_bytes": self.wire_bytes, f"{prefix}/bits_per_coord": self.bits_per_coord}
        if self.vnmse is not None:
            metrics[f"{prefix}/vnmse"] = self.vnmse
        self.__init__()
        return metrics
