// The activations of activated BatchNorm, shared by the CPU kernels, the CUDA
// kernels (this header needs nothing but C++) and the bindings.
#pragma once

namespace effilayers {

enum class Activation : int { Identity = 0, LeakyRelu = 1, Elu = 2, Relu = 3 };

}  // namespace effilayers
