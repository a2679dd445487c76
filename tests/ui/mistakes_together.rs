use fusion::prelude::*;

fusion! {
    /// Independent mistakes of every kind are reported together: a failed `let` with a
    /// declared type still lets what reads it be checked (`h + c`).
    fn f<m, n>(
        a: Tensor<f32, [m, q]>,
        b: Tensor<f64, [m, n]>,
        c: Tensor<f32, [m, n]>,
    ) -> Tensor<f32, [m, n]> {
        let x = rleu(c);
        let y = relu(zz);
        let h: Tensor<f32, [m, m]> = sigmod(c);
        let z = max(c, c);
        let w = matmul(c, relu(c));
        h + c
    }
}

fn main() {}
