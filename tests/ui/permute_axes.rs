use fusion::prelude::*;

fusion! {
    /// Each mistake is in the permutation, and the caret is on the axis (or list) at fault.
    fn too_few_axes<a, b, c>(x: Tensor<f32, [a, b, c]>) -> Tensor<f32, [b, a]> {
        permute(x, [1, 0])
    }

    fn axis_listed_twice<a, b, c>(x: Tensor<f32, [a, b, c]>) -> Tensor<f32, [c, a, c]> {
        permute(x, [2, 0, 2])
    }

    fn axis_out_of_range<a, b>(x: Tensor<f32, [a, b]>) -> Tensor<f32, [b, a]> {
        permute(x, [2, 0])
    }

    fn transpose_out_of_range<a, b>(x: Tensor<f32, [a, b]>) -> Tensor<f32, [b, a]> {
        transpose(x, 0, 3)
    }

    fn not_a_list<a, b>(x: Tensor<f32, [a, b]>) -> Tensor<f32, [b, a]> {
        permute(x, 1)
    }

    /// The result's declared axes are the permuted ones, with their annotations.
    fn declared_unpermuted<d, m, k>(x: Tensor<f32, [d @ DIDx, m, k]>) -> Tensor<f32, [d @ DIDx, k, m]> {
        let y: Tensor<f32, [d @ DIDx, m, k]> = transpose(x, 1, 2);
        y
    }
}

fn main() {}
