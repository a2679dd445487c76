use fusion::prelude::*;

fusion! {
    /// `max` has no adjoint: the backward asked for by `#[backward]` is refused on it.
    #[backward]
    fn peak<m, n>(a: Tensor<f32, [m, n]>, w: Tensor<f32, [n, n]>) -> Tensor<f32, [m]> {
        let h = gelu(matmul(a, w));
        max(h, 1)
    }

    /// A derivative op has no derivative of its own.
    #[backward(a)]
    fn slope<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        gelu_grad(a) * a
    }

    /// Only inputs can want gradients.
    #[backward(b)]
    fn unknown<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        relu(a)
    }
}

fn main() {}
