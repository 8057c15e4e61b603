"""Where ranks sit: :mod:`.layout` (pure layout math and validation), :mod:`.fleet` (the
``fsdp_outer_degree`` option, HSDP groups of fleet's HCG and the HCG methods' bodies),
:mod:`.mesh` (which groups a unit talks to: the HCG or an explicit mesh) and
:mod:`.cost` (bytes one optimizer step moves and holds, for a layout)."""
