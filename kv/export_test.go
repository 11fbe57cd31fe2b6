package kv

// KindsOf returns the tensors each layer of g has, in order, for tests that walk every
// tensor of a sequence without assuming a K and a V per layer.
func KindsOf(g Geometry) []Kind { return g.kinds() }
