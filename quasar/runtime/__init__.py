"""Running quantized models: the W8A8 and W4A8 layers and their reference numbers, the fused
whole-step op's feeding, and the heads that score a step's rows. Nothing here quantizes;
`quasar.quant` makes what these modules run."""
